"""`NeMoLogger`: where a run writes its logs and checkpoints, with NeMo's arguments.

    <log_dir>/<name>/
        checkpoints/                    shared by every run of the experiment (`ModelCheckpoint`, `AutoResume`)
        <version>/                      one per run, a resumed run included: nothing is ever overwritten
            events.out.tfevents.*       TensorBoard
            metrics.csv hparams.yaml    CSV
            nemo_log_globalrank-R_localrank-L.txt
            config.yaml cmd-args.log    what ran, and its command line

`version` defaults to the start time (`2026-11-25_11-16-12`); `explicit_log_dir` replaces `<log_dir>/<name>/<version>`
(a run resumed there writes its CSV to a fresh `metrics_<k>/` in it, its TensorBoard events beside the old ones).
"""

import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger

from nemo_ckpt import _compat
from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint
from nemo_ckpt.logger.checkpoint_metrics import CheckpointMetrics
from nemo_ckpt.logger.metrics import StepMetrics
from nemo_ckpt.logger.progress import ProgressPrinter
from nemo_ckpt.logger.run_config import describe, write_run_config
from nemo_ckpt.logger.text_log import TextLog, global_rank, quiet_console, slurm_attempt_line, verbose_requested
from nemo_ckpt.options import strict_options

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
DATETIME_VERSION = "%Y-%m-%d_%H-%M-%S"
# NeMo NeMoLogger options not implemented here, with what they mean in NeMo.
NEMO_UNSUPPORTED = {
    "log_local_rank_0_only": "only local rank 0 of each node writes a text log; use log_global_rank_0_only",
    "files_to_copy": "files copied into the log directory; the run's config.yaml and cmd-args.log are written",
}


@strict_options(NEMO_UNSUPPORTED)
@dataclass
class NeMoLogger:
    """Logs of a run under `<log_dir>/<name>/<version>/`, checkpoints under `<log_dir>/<name>/checkpoints/`.

    - `version`: the run's directory name; default: the start time (`use_datetime_version`), else `version_<N>`,
      the next free number. A resumed run gets a new version beside the old ones.
    - `explicit_log_dir`: use this directory instead of `<log_dir>/<name>/<version>` (checkpoints in its
      `checkpoints/`).
    - `tensorboard`: True (default) for Lightning's `TensorBoardLogger` in the version directory, a
      `TensorBoardLogger` of your own, or False. `wandb`: a `WandbLogger` (needs `wandb` installed). `csv`:
      Lightning's `CSVLogger` in the version directory. `extra_loggers`: any other Lightning loggers.
    - Loggers already on the Trainer are kept; with `update_logger_directory` (default), theirs and a given
      `tensorboard` logger write under the version directory (keeping their own name and version).
    - `progress`: the console progress line on global rank 0 (`ProgressPrinter`) and the per-step metrics
      (`StepMetrics`: step time, tokens/s, TFLOP/s per device, MFU, memory; `CheckpointMetrics`: how long
      each save blocked training, checkpoint size) to every logger.
      `peak_tflops_per_device`: the device peak for MFU when the built-in table does not know the device.
    - `verbose` (or `LOGLEVEL=INFO`): keep Lightning's start-up notices (GPU available, tips, ...) on the
      console; they are always in the text log. `log_global_rank_0_only`: only global rank 0 writes a text log.
    - `ckpt`: the `ModelCheckpoint`, saving to `<log_dir>/<name>/checkpoints` unless its `dirpath` is set.
    """

    name: str = "default"
    log_dir: str = "nemo_experiments"
    explicit_log_dir: str | None = None
    version: str | None = None
    use_datetime_version: bool = True
    log_global_rank_0_only: bool = False
    update_logger_directory: bool = True
    ckpt: ModelCheckpoint | None = None
    tensorboard: TensorBoardLogger | bool = True
    wandb: WandbLogger | None = None
    csv: bool = True
    extra_loggers: list[Logger] = field(default_factory=list)
    progress: bool = True
    peak_tflops_per_device: float | None = None
    verbose: bool = False
    run_dir: Path | None = field(default=None, init=False)
    """The directory of this run's logs, once `setup` has chosen it (on global rank 0; other ranks learn it in
    the `setup` hook of `TextLog`)."""

    def __post_init__(self) -> None:
        if not self.name or os.sep in self.name:
            raise ValueError(f"NeMoLogger(name={self.name!r}): give a non-empty name without {os.sep!r}")
        if self.version is not None and (not self.version or os.sep in self.version):
            raise ValueError(f"NeMoLogger(version={self.version!r}): give a non-empty name without {os.sep!r}")
        if not isinstance(self.tensorboard, (bool, TensorBoardLogger)):
            raise TypeError(
                f"NeMoLogger(tensorboard={self.tensorboard!r}): use True, False or a lightning TensorBoardLogger"
            )
        if self.wandb is not None and not isinstance(self.wandb, WandbLogger):
            raise TypeError(f"NeMoLogger(wandb={self.wandb!r}): use a lightning WandbLogger or None")
        if self.peak_tflops_per_device is not None and self.peak_tflops_per_device <= 0:
            raise ValueError(f"NeMoLogger(peak_tflops_per_device={self.peak_tflops_per_device}): must be > 0")

    @property
    def experiment_dir(self) -> Path:
        """`<log_dir>/<name>` (or `explicit_log_dir`): the versions and the checkpoints of the experiment."""
        return Path(self.explicit_log_dir) if self.explicit_log_dir else Path(self.log_dir) / self.name

    @property
    def checkpoint_dir(self) -> Path:
        if self.ckpt is not None and self.ckpt.dirpath is not None:
            return Path(self.ckpt.dirpath)
        return self.experiment_dir / CHECKPOINTS

    def setup(self, trainer: pl.Trainer, task_config: Mapping[str, Any] | None = None) -> Path:
        """Choose and create this run's directory, attach the loggers and callbacks to `trainer`, write
        `task_config` (the objects the run was built from) as `config.yaml`; return the run directory."""
        rank = global_rank()
        self.run_dir = self._choose_run_dir(create=rank == 0)
        loggers = list(trainer.loggers)
        if self.update_logger_directory:
            for logger in loggers:
                if isinstance(logger, (TensorBoardLogger, CSVLogger)):
                    _compat.redirect_logger(logger, self.run_dir)
        loggers += self._loggers(rank)
        trainer.loggers = list({id(logger): logger for logger in loggers}.values())

        quiet_console(not (self.verbose or verbose_requested()))
        text_log = TextLog(self.run_dir, self.log_global_rank_0_only)
        if rank == 0:
            text_log.open()
        if attempt := slurm_attempt_line():
            log.warning(attempt)
        callbacks: list[pl.Callback] = [text_log]
        if self.progress:
            step_metrics = StepMetrics(self.peak_tflops_per_device)
            checkpoint_dir = self.checkpoint_dir if self.ckpt is not None else None
            callbacks += [step_metrics, ProgressPrinter(step_metrics), CheckpointMetrics(checkpoint_dir)]
        if self.ckpt is not None:
            self.ckpt.dirpath = self.checkpoint_dir
            callbacks.append(self.ckpt)
        trainer.callbacks.extend(callback for callback in callbacks if callback not in trainer.callbacks)

        if task_config is not None:  # also the loggers' hyperparameters (hparams.yaml, TensorBoard), on rank 0
            description = describe(task_config)
            for logger in trainer.loggers:
                logger.log_hyperparams(description)
        if rank == 0:
            (self.run_dir / "cmd-args.log").write_text(" ".join(sys.argv) + "\n")
            if task_config is not None:
                write_run_config(self.run_dir / "config.yaml", description)
        return self.run_dir

    def _choose_run_dir(self, create: bool) -> Path:
        if self.explicit_log_dir:
            run_dir = Path(self.explicit_log_dir)
        elif self.version is not None:
            run_dir = self.experiment_dir / self.version
        elif self.use_datetime_version:
            started = time.strftime(DATETIME_VERSION)
            run_dir, suffix = self.experiment_dir / started, 0
            while run_dir.exists():  # two runs started within one second
                suffix += 1
                run_dir = self.experiment_dir / f"{started}_{suffix}"
        else:
            number = 0
            while (self.experiment_dir / f"version_{number}").exists():
                number += 1
            run_dir = self.experiment_dir / f"version_{number}"
        if create:
            run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir

    def _loggers(self, rank: int) -> list[Logger]:
        loggers: list[Logger] = []
        if self.csv:
            # Lightning's CSV writer deletes a metrics.csv already in its directory: a run reusing a directory
            # (explicit_log_dir, a given version) writes to a fresh `metrics_<k>/` in it instead.
            version, k = "", 0
            while self.run_dir.is_dir() and any((self.run_dir / version).iterdir()):
                k += 1
                version = f"metrics_{k}"
                if not (self.run_dir / version).exists():
                    break
            csv_logger = CSVLogger(self.run_dir, name="", version=version, flush_logs_every_n_steps=10)
            if rank == 0:
                csv_logger.experiment  # noqa: B018 - open the writer now, before this run's other files exist
            loggers.append(csv_logger)
        if self.tensorboard is True:
            loggers.append(TensorBoardLogger(self.run_dir, name="", version="", default_hp_metric=False))
        elif isinstance(self.tensorboard, TensorBoardLogger):
            if self.update_logger_directory:
                _compat.redirect_logger(self.tensorboard, self.run_dir)
            loggers.append(self.tensorboard)
        if self.wandb is not None:
            loggers.append(self.wandb)
        return loggers + list(self.extra_loggers)

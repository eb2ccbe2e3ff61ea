"""`CheckpointMetrics`: how long a checkpoint save held training up, and how big the checkpoint is, measured from
outside `ModelCheckpoint` (which saves in its own `on_train_batch_end`, the last callback of a step)."""

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from nemo_ckpt.checkpoint.manifest import Manifest
from nemo_ckpt.logger.progress import PROGRESS_LOGGER

GIB = 2**30


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path`."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file() and not file.is_symlink())


class CheckpointMetrics(pl.Callback):
    """For each checkpoint saved after a training step: `checkpoint_blocking_time` (s: from the end of the step to
    the next hook, so the whole save for a synchronous one, the staging for an async one) and, when the save is
    committed by then, `checkpoint_size` (GiB, every rank's files). Printed on global rank 0 and written to every
    logger at the step axis position of the step the checkpoint holds (where that step's loss is).

    The total time of an async save (until its commit in the background) is not measured: it ends inside
    `ModelCheckpoint`.
    """

    def __init__(self, checkpoint_dir: Path | None = None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self._step_end: float | None = None
        self._saved_step: int | None = None
        self._logger = logging.getLogger(PROGRESS_LOGGER)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._step_end = time.perf_counter()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if trainer.training and self._step_end is not None:
            self._saved_step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._measure(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measure(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measure(trainer)

    def _measure(self, trainer: pl.Trainer) -> None:
        if self._saved_step is None or self._step_end is None:
            return
        blocking = time.perf_counter() - self._step_end
        step, self._saved_step = self._saved_step, None
        if not trainer.is_global_zero:
            return
        size = self._size(step)
        metrics = {"checkpoint_blocking_time": blocking}
        if size is not None:
            metrics["checkpoint_size"] = size / GIB
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)  # training step `step` is logged at index step - 1
        shown = "n/a (not committed yet)" if size is None else f"{size / 2**20:.2f} MiB"
        self._logger.info(f"checkpoint of step {step}: blocked training {blocking:.3f}s, size {shown}")

    def _size(self, step: int) -> int | None:
        if self.checkpoint_dir is None:
            return None
        manifest = Manifest.read(self.checkpoint_dir)
        names = [record.name for record in manifest.checkpoints if record.step == step and record.state == "complete"]
        return directory_bytes(self.checkpoint_dir / names[-1]) if names else None

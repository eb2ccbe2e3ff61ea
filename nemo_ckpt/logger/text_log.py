"""Each rank's text log in the run directory, and the quiet console (Lightning's start-up notices filtered)."""

import logging
import os
import socket
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist

from nemo_ckpt.logger.progress import PROGRESS_LOGGER

TEXT_LOGGERS = ("nemo_ckpt", PROGRESS_LOGGER, "lightning.pytorch", "lightning.fabric")
"""Loggers whose records go to the text log (Lightning's at INFO, as it sets them; nemo_ckpt's at their level)."""

LIGHTNING_NOTICES = (
    "GPU available:",
    "TPU available:",
    "HPU available:",
    "💡 Tip",
    "LOCAL_RANK:",
    "----------------------------------------------------------------------------------------------------\n"
    "distributed_backend=",
)
"""Start-up notices of Lightning kept off the console unless verbose (they are still in the text log)."""
IRRELEVANT_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)  # Lightning 2.6 on torch 2.13
VERBOSE_LOGLEVELS = ("DEBUG", "INFO")


def global_rank() -> int:
    """This process's global rank: the process group's, else torchrun's `RANK`, Slurm's `SLURM_PROCID`, or 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def text_log_name(rank: int, local_rank: int) -> str:
    """NeMo's name of a rank's text log."""
    return f"nemo_log_globalrank-{rank}_localrank-{local_rank}.txt"


class QuietConsole(logging.Filter):
    """Drops Lightning's start-up notices (`LIGHTNING_NOTICES`) from a console handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(LIGHTNING_NOTICES)


_QUIET = QuietConsole()


def verbose_requested() -> bool:
    """Whether the environment asks for every notice: `LOGLEVEL=INFO` or `DEBUG` (torchrun's variable)."""
    return os.environ.get("LOGLEVEL", "").upper() in VERBOSE_LOGLEVELS


def slurm_attempt_line() -> str | None:
    """`Slurm job <id>: attempt <n> on <host>` for the first process of each node of a Slurm job, else None: it marks
    where each attempt of a requeued job starts in the job's one log (`launch.slurm.JobLog`)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return None
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", 0)) + 1
    return f"Slurm job {job_id}: attempt {attempt} on {socket.gethostname()}"


def launcher_env() -> dict[str, str]:
    """Env vars for the torchrun an executor starts: its agent's log at WARNING (NeMo-Run defaults `LOGLEVEL` to
    INFO, a page of agent lines per run) unless this shell sets `LOGLEVEL`, and `OMP_NUM_THREADS=1` unless set
    (what torchrun sets anyway, without its banner)."""
    return {
        "LOGLEVEL": os.environ.get("LOGLEVEL", "WARNING"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def quiet_console(quiet: bool) -> None:
    """Filter (or stop filtering) Lightning's start-up notices from its console handlers, and ignore warnings
    that do not concern the user (`IRRELEVANT_WARNINGS`). Applied when this module is imported (by `NeMoLogger`,
    before a recipe builds its Trainer, which prints them) unless `verbose_requested()`; `NeMoLogger(verbose=...)`
    sets it again."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                (handler.addFilter if quiet else handler.removeFilter)(_QUIET)
    if quiet:
        for message in IRRELEVANT_WARNINGS:
            warnings.filterwarnings("ignore", message=message)


class TextLog(pl.Callback):
    """Writes the records of `TEXT_LOGGERS` to `<run_dir>/nemo_log_globalrank-R_localrank-L.txt` (global rank 0 only
    with `global_rank_0_only`).

    `NeMoLogger.setup` calls `open` on every rank before training (global rank 0 opens its file then, so it also
    holds what happens before `fit`); every other rank opens its file in `setup`, once the process group exists,
    in the run directory global rank 0 chose (its version name is a timestamp, which ranks need not agree on).
    """

    def __init__(self, run_dir: Path, global_rank_0_only: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.global_rank_0_only = global_rank_0_only
        self.path: Path | None = None
        self._handler: logging.FileHandler | None = None
        self._console: logging.StreamHandler | None = None

    def open(self) -> None:
        """Start writing this rank's text log (into the existing run directory)."""
        rank = global_rank()
        if self._handler is None and (rank == 0 or not self.global_rank_0_only):
            self.path = self.run_dir / text_log_name(rank, int(os.environ.get("LOCAL_RANK", 0)))
            self._handler = logging.FileHandler(self.path, encoding="utf-8")
            self._handler.setFormatter(logging.Formatter("[%(asctime)s %(levelname)s %(name)s] %(message)s"))
            for name in TEXT_LOGGERS:
                logging.getLogger(name).addHandler(self._handler)
            if not logging.getLogger().handlers:
                # the file handler ends Python's last-resort console output of nemo_ckpt's warnings: keep them shown
                self._console = logging.StreamHandler()
                self._console.setLevel(logging.WARNING)
                logging.getLogger("nemo_ckpt").addHandler(self._console)

    def close(self) -> None:
        """Stop writing the text log."""
        if self._handler is not None:
            for name in TEXT_LOGGERS:
                logging.getLogger(name).removeHandler(self._handler)
            if self._console is not None:
                logging.getLogger("nemo_ckpt").removeHandler(self._console)
                self._console = None
            self._handler.close()
            self._handler = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.run_dir = Path(trainer.strategy.broadcast(str(self.run_dir), src=0))
        self.open()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.close()


quiet_console(not verbose_requested())

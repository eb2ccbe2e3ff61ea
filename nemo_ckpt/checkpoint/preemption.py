"""`PreemptionCallback`: on Slurm's warning signal, checkpoint, stop and requeue the job (like NeMo's); on SIGTERM,
checkpoint and stop.

Slurm sends the signal of `sbatch --signal=USR1@60` to every process of the job's steps 60 s (give or
take up to a minute) before the time limit, and `scancel --signal=USR1 <job>` sends it on demand.
Each training process catches it; at the end of the current step the ranks agree on it, save a
checkpoint through the run's `ModelCheckpoint`, and stop. Global rank 0 then flushes the loggers
and runs `scontrol requeue $SLURM_JOB_ID`; the requeued job resumes from that checkpoint through
`AutoResume(resume_if_exists=True)`. Without the signal the callback does nothing.

`stop_signals` (default SIGTERM) do the same without the requeue: Ctrl-C or `kill` to `nemo` for a local run
(`launch.job`, which sends torchrun SIGTERM; torchrun forwards it to every rank), `scancel` and the time limit on
Slurm (whose SIGKILL follows after the cluster's `KillWait`). Lightning's own SIGTERM handler, which the callback
replaces for the time of training, broadcasts from inside the handler, a collective out of order with the ranks'
own, which can deadlock them (seen: both ranks in that broadcast, one of them inside backward's all-reduce).

torchrun itself must survive the signal: its default action for SIGUSR1 is to die. `launch.slurm`
adds the signal to torchrun's `PET_SIGNALS_TO_HANDLE`, so the agent forwards it and waits for
the workers to save and exit.
"""

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint

log = logging.getLogger(__name__)


def signal_number(name: str) -> signal.Signals:
    """`"USR1"`, `"SIGUSR1"` or `"10"` as a `signal.Signals`."""
    try:
        return signal.Signals(int(name)) if name.isdigit() else signal.Signals[f"SIG{name.upper().removeprefix('SIG')}"]
    except (KeyError, ValueError):
        raise ValueError(f"{name!r} is not a signal name or number, e.g. 'SIGUSR1'") from None


class PreemptionCallback(Callback):
    """Checkpoint and stop at the end of the step during which `signal` or one of `stop_signals` arrived; after
    `signal`, requeue the Slurm job.

    `requeue=False` only checkpoints and stops. The job is requeued only while training is unfinished
    (`global_step < max_steps`), `SLURM_JOB_ID` is set and global rank 0 received no stop signal. A `signal` also
    in `stop_signals` requeues.
    """

    _received: set[signal.Signals]  # by this rank (in `__init__`, `signal` is the argument, not the module)
    _previous_stop_handlers: dict[signal.Signals, Any]

    def __init__(
        self, signal: str = "SIGUSR1", requeue: bool = True, stop_signals: Sequence[str] = ("SIGTERM",)
    ) -> None:
        self.signal = signal_number(signal)
        self.requeue = requeue
        self.stop_signals = tuple(s for s in map(signal_number, stop_signals) if s != self.signal)  # `signal` wins
        self.preempted_step: int | None = None
        self._received = set()
        self._previous_handler: Any = None
        self._previous_stop_handlers = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received.add(signal.Signals(signum))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not self._checkpoint_callbacks(trainer):
            raise ValueError(
                "PreemptionCallback needs a nemo_ckpt ModelCheckpoint in trainer.callbacks to save to: "
                "set NeMoLogger(ckpt=ModelCheckpoint(...)), or remove PreemptionCallback"
            )
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionCallback installs a signal handler and so must run in the main thread")
        self._received = set()
        self.preempted_step = None
        self._previous_handler = signal.signal(self.signal, self._handle)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after Lightning installed its SIGTERM handler (set-up is before): replace it until training ends
        self._previous_stop_handlers = {signum: signal.signal(signum, self._handle) for signum in self.stop_signals}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not trainer.strategy.reduce_boolean_decision(bool(self._received), all=False):
            return
        reason = "/".join(sorted(received.name for received in self._received)) or "a signal to another rank"
        for checkpoint in self._checkpoint_callbacks(trainer):
            path = checkpoint.save(trainer)
            if trainer.is_global_zero:
                log.warning("Received %s: saved %s at step %d; stopping", reason, path, trainer.global_step)
        self.preempted_step = trainer.global_step
        trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_stop_handlers()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore_stop_handlers()

    def _restore_stop_handlers(self) -> None:
        """Put back Lightning's handlers before its teardown restores the ones from before training."""
        for signum, handler in self._previous_stop_handlers.items():
            signal.signal(signum, handler)
        self._previous_stop_handlers = {}

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._previous_handler is None:
            return
        signal.signal(self.signal, self._previous_handler)
        self._previous_handler = None
        job_id = os.environ.get("SLURM_JOB_ID")
        stopped = bool(self._received.intersection(self.stop_signals))  # on rank 0, which decides
        finished = self.preempted_step is None or 0 <= trainer.max_steps <= self.preempted_step
        if self.requeue and not stopped and not finished and job_id and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
            log.warning("Requeueing Slurm job %s to resume from step %d", job_id, self.preempted_step)
            subprocess.run(["scontrol", "requeue", job_id], check=True)

    @staticmethod
    def _checkpoint_callbacks(trainer: pl.Trainer) -> list[ModelCheckpoint]:
        return [callback for callback in trainer.callbacks if isinstance(callback, ModelCheckpoint)]

"""`PreemptionCallback`: on Slurm's warning signal, checkpoint, stop and requeue the job (like NeMo's).

Slurm sends the signal of `sbatch --signal=USR1@60` to every process of the job's steps 60 s (give or
take up to a minute) before the time limit, and `scancel --signal=USR1 <job>` sends it on demand.
Each training process catches it; at the end of the current step the ranks agree on it, save a
checkpoint through the run's `ModelCheckpoint`, and stop. Global rank 0 then flushes the loggers
and runs `scontrol requeue $SLURM_JOB_ID`; the requeued job resumes from that checkpoint through
`AutoResume(resume_if_exists=True)`. Without the signal the callback does nothing.

torchrun itself must survive the signal: its default action for SIGUSR1 is to die. `launch.slurm`
adds the signal to torchrun's `PET_SIGNALS_TO_HANDLE`, so the agent forwards it and waits for
the workers to save and exit.
"""

import logging
import os
import signal
import subprocess
import threading
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
    """Checkpoint and stop at the end of the step during which `signal` arrived; requeue the Slurm job.

    `requeue=False` only checkpoints and stops. The job is requeued only while training is unfinished
    (`global_step < max_steps`) and `SLURM_JOB_ID` is set.
    """

    def __init__(self, signal: str = "SIGUSR1", requeue: bool = True) -> None:
        self.signal = signal_number(signal)
        self.requeue = requeue
        self.preempted_step: int | None = None
        self._received = False
        self._previous_handler: Any = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received = True

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
        self._received = False
        self.preempted_step = None
        self._previous_handler = signal.signal(self.signal, self._handle)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not trainer.strategy.reduce_boolean_decision(self._received, all=False):
            return
        for checkpoint in self._checkpoint_callbacks(trainer):
            path = checkpoint.save(trainer)
            if trainer.is_global_zero:
                log.warning("Received %s: saved %s at step %d; stopping", self.signal.name, path, trainer.global_step)
        self.preempted_step = trainer.global_step
        trainer.should_stop = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._previous_handler is None:
            return
        signal.signal(self.signal, self._previous_handler)
        self._previous_handler = None
        job_id = os.environ.get("SLURM_JOB_ID")
        finished = self.preempted_step is None or 0 <= trainer.max_steps <= self.preempted_step
        if self.requeue and not finished and job_id and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
            log.warning("Requeueing Slurm job %s to resume from step %d", job_id, self.preempted_step)
            subprocess.run(["scontrol", "requeue", job_id], check=True)

    @staticmethod
    def _checkpoint_callbacks(trainer: pl.Trainer) -> list[ModelCheckpoint]:
        return [callback for callback in trainer.callbacks if isinstance(callback, ModelCheckpoint)]

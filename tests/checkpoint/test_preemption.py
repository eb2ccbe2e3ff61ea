"""`PreemptionCallback` on SIGTERM (a local run's Ctrl-C, Slurm's `scancel`): the ranks agree at the end of the step,
save a checkpoint, stop, and do not requeue; Lightning's SIGTERM handler is out of the way during training and back
after it. (SIGUSR1 preemption with the requeue runs on a real Slurm: `tests/slurm/test_two_nodes.py`.)"""

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import nemo_run as run

from nemo_ckpt.checkpoint.manifest import Manifest
from nemo_ckpt.checkpoint.preemption import PreemptionCallback
from tests.helpers.distributed import run_recipe
from tests.helpers.recipe import checkpoint_dir, tiny_recipe

STEP = 3


class SignalAt(pl.Callback):
    """At the end of step `step`, send this process `signum` (on global rank `rank` only); check that the handler
    during training is `PreemptionCallback`'s, Lightning never saw the signal, and set-up's handler is back after."""

    def __init__(self, step: int, rank: int, signum: int) -> None:
        self.step, self.rank, self.signum = step, rank, signum
        self.before: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.before = signal.getsignal(self.signum)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        handler = signal.getsignal(self.signum)
        assert isinstance(getattr(handler, "__self__", None), PreemptionCallback), handler
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        assert not trainer.received_sigterm, "Lightning's handler ran"
        assert signal.getsignal(self.signum) == self.before, "the handler from before training is back"
        assert trainer.global_step == self.step, trainer.global_step


def signalled_recipe(directory: str, world_size: int, signum: int) -> run.Partial:
    callbacks = [run.Config(SignalAt, step=STEP, rank=1, signum=signum), run.Config(PreemptionCallback)]
    return tiny_recipe(directory, 50, world_size, callbacks, monitor=None, every_n_train_steps=1000, save_last=False)


def test_sigterm_to_one_rank_checkpoints_and_stops_all_at_the_end_of_the_step(tmp_path: Path) -> None:
    status = run_recipe(signalled_recipe, 2, str(tmp_path), 2, signal.SIGTERM, logs=tmp_path)

    assert status == 0, (tmp_path / "rank0.log").read_text()[-3000:]
    assert [record.step for record in Manifest.read(checkpoint_dir(tmp_path)).complete()] == [STEP]
    log = (tmp_path / "rank0.log").read_text()
    assert "Received a signal to another rank: saved" in log, "rank 1 got it; rank 0 logs"
    assert f"at step {STEP}; stopping" in log and "Requeueing" not in log


def test_the_requeue_signal_wins_over_the_same_stop_signal() -> None:
    callback = PreemptionCallback(signal="SIGTERM")
    assert (callback.signal, callback.stop_signals) == (signal.SIGTERM, ())
    assert PreemptionCallback(stop_signals=["INT", "15"]).stop_signals == (signal.SIGINT, signal.SIGTERM)

"""One rank of the tiny recipe for the crash tests, started from a forkserver that has imported everything, so a
2-rank run starts in well under a second and can be SIGKILLed many times per test. A rank given a pause point pauses
there (`nemo_ckpt.dist_checkpointing.fault_points`), so the test's SIGKILL lands at that point."""

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from nemo_ckpt.dist_checkpointing.fault_points import PAUSE_AT, PAUSE_MARKER
from tests.helpers.recipe import train

SAVE_EVERY = 2


class Progress(pl.Callback):
    """Rank 0 appends `start <step>` once training starts (after any resume), `step <step>` after each optimizer
    step, before that step's checkpoint is saved, and `batch <step>` when the next batch starts (after that save
    returned, before async saves are polled); unbuffered, so a SIGKILL loses nothing written."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _event(self, trainer: pl.Trainer, text: str) -> None:
        if trainer.is_global_zero:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{text}\n".encode())
            os.close(fd)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._event(trainer, f"start {trainer.global_step}")

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._event(trainer, f"batch {trainer.global_step}")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._event(trainer, f"step {trainer.global_step}")


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    directory: str,
    max_steps: int,
    async_save: bool,
    save_top_k: int,
    progress: str,
    log: str,
    pause_at: str | None = None,
    pause_marker: str | None = None,
) -> None:
    """Train as rank `rank` of `world_size` (torchrun's environment), output to `log`; with `pause_at`
    (`<point>[@<n>]`), pause there, writing `pause_marker` once paused."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        NODE_RANK="0",
    )
    if pause_at is not None:
        os.environ.update({PAUSE_AT: pause_at, PAUSE_MARKER: str(pause_marker)})
    train(
        Path(directory),
        max_steps,
        world_size,
        callbacks=[Progress(progress)],
        async_save=async_save,
        every_n_train_steps=SAVE_EVERY,
        save_top_k=save_top_k,
        monitor="reduced_train_loss",
    )

"""Train the tiny recipe in this process (run under torchrun), optionally killed with SIGKILL at a step.

    python -m torch.distributed.run --nproc-per-node 2 -m tests.tiny_run DIR MAX_STEPS [KILL_AT_STEP]
"""

import os
import signal
import sys

import fiddle as fdl
import lightning.pytorch as pl
import nemo_run as run

from recipes import pretrain_recipe


class KillAtStep(pl.Callback):
    """SIGKILL rank 0 once `step` optimizer steps are done: a crash, not a clean exit."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGKILL)


def tiny_recipe(directory: str, max_steps: int, kill_at_step: int | None = None) -> run.Partial:
    recipe = pretrain_recipe(name="tiny", dir=directory, num_gpus_per_node=int(os.environ.get("WORLD_SIZE", 1)),
                             max_steps=max_steps)
    recipe.log.ckpt.every_n_train_steps = 5
    recipe.log.ckpt.save_top_k = -1
    if kill_at_step is not None:
        recipe.trainer.callbacks = [run.Config(KillAtStep, step=kill_at_step)]
    return recipe


if __name__ == "__main__":
    directory, max_steps, *kill = sys.argv[1:]
    fdl.build(tiny_recipe(directory, int(max_steps), int(kill[0]) if kill else None))()

"""The tiny recipe on 2 ranks with torchrun's environment (`run_recipe`), optionally with MegatronStrategy options
and killed with SIGKILL at a step, and readers of what such a run leaves on disk."""

import csv
import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import nemo_run as run

from nemo_ckpt.logger.runs import version_dirs
from recipes import pretrain_recipe
from tests.helpers.distributed import run_recipe

RUN_NAME = "tiny"


class KillAtStep(pl.Callback):
    """SIGKILL rank 0 once `step` optimizer steps are done: a crash, not a clean exit. Async saves still in flight
    are committed first (every rank waits for them), so what a resume finds does not depend on the disk's speed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step != self.step:
            return
        trainer.strategy.checkpoint_io.maybe_finalize(blocking=True)
        if trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGKILL)


def tiny_recipe(
    directory: str, max_steps: int, options: dict[str, Any] | None = None, kill_at_step: int | None = None
) -> run.Partial:
    """The tiny recipe checkpointing every 5 steps, keeping all, with `options` set on its strategy (a dotted
    name, `data.global_batch_size`, is set on the recipe instead)."""
    recipe = pretrain_recipe(
        name=RUN_NAME, dir=directory, num_gpus_per_node=int(os.environ.get("WORLD_SIZE", 1)), max_steps=max_steps
    )
    recipe.log.ckpt.every_n_train_steps = 5
    recipe.log.ckpt.save_top_k = -1
    for name, value in (options or {}).items():
        *parents, leaf = name.split(".")
        target = recipe if parents else recipe.trainer.strategy
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    if kill_at_step is not None:
        recipe.trainer.callbacks = [run.Config(KillAtStep, step=kill_at_step)]
    return recipe


def run_tiny(
    directory: Path, max_steps: int, options: dict[str, Any] | None = None, kill_at_step: int | None = None
) -> int:
    """Run `tiny_recipe` on 2 ranks; return 0 or the exit code of the rank that failed (`run_recipe`)."""
    return run_recipe(tiny_recipe, 2, str(directory), max_steps, options, kill_at_step)


def checkpoints(directory: Path) -> Path:
    """The checkpoint directory of a run under `directory`."""
    return directory / RUN_NAME / "checkpoints"


def step_dir(directory: Path, step: int) -> Path:
    """The checkpoint of `step`, found through the manifest."""
    manifest = json.loads((checkpoints(directory) / "checkpoints.json").read_text())
    [name] = [record["name"] for record in manifest["checkpoints"] if record["step"] == step]
    return checkpoints(directory) / name


def losses(directory: Path) -> dict[int, float]:
    """The training loss of each step, as the latest run (NeMoLogger version) under `directory` logged it."""
    with open(version_dirs(directory / RUN_NAME)[-1] / "metrics.csv") as handle:
        return {
            int(row["step"]): float(row["reduced_train_loss"])
            for row in csv.DictReader(handle)
            if row["reduced_train_loss"]
        }

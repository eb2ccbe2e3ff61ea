"""Train the tiny recipe through `pretrain` inside a rank (a `run_distributed` rank or a crash-test process)."""

import functools
from pathlib import Path
from typing import Any

import fiddle as fdl
import lightning.pytorch as pl
import nemo_run as run

from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint
from nemo_ckpt.checkpoint.resume import AutoResume
from recipes import pretrain_recipe

RUN_NAME = "tiny"


def checkpoint_dir(directory: str | Path) -> Path:
    return Path(directory) / RUN_NAME / "checkpoints"


def tiny_recipe(
    directory: str | Path,
    max_steps: int,
    world_size: int,
    callbacks: list[pl.Callback] = (),
    async_save: bool = False,
    resume: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
    **ckpt: Any,
) -> run.Partial:
    """The tiny recipe with `ModelCheckpoint(**ckpt)`, extra trainer `callbacks`, `AutoResume(**resume)`
    (default: resume if a checkpoint exists) and `overrides` of dotted recipe paths (`"model.config.num_layers"`)."""
    recipe = pretrain_recipe(name=RUN_NAME, dir=str(directory), num_gpus_per_node=world_size, max_steps=max_steps)
    recipe.trainer.accelerator = "cpu"
    recipe.trainer.callbacks = list(callbacks)
    recipe.trainer.strategy.ckpt_async_save = async_save
    recipe.log.ckpt = run.Config(ModelCheckpoint, **ckpt)
    recipe.resume = run.Config(
        AutoResume, **(resume or {"resume_if_exists": True, "resume_ignore_no_checkpoint": True})
    )
    for path, value in (overrides or {}).items():
        *parents, name = path.split(".")
        setattr(functools.reduce(getattr, parents, recipe), name, value)
    return recipe


def train(directory: str | Path, max_steps: int, world_size: int, **kwargs: Any) -> Path:
    """Run `tiny_recipe(...)`; return the checkpoint directory."""
    return fdl.build(tiny_recipe(directory, max_steps, world_size, **kwargs))()

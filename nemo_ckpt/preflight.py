"""Checks of a `pretrain` / `finetune` task that need no processes, run before anything is launched.

`check_task(task)` builds the parts of a recipe that are cheap to build (the data module, with its tokenizer and
datasets, and the model's config) and checks what would otherwise fail minutes later on every rank: unknown
options, missing paths, a resume or restore path that is not a complete checkpoint. The `nemo` command line runs it
before it starts torchrun or submits a job; `pretrain` and `finetune` run it again in each process.
"""

from typing import Any

import fiddle as fdl

from nemo_ckpt.options import check_config_options


class PreflightError(ValueError):
    """A task that cannot run, found before launching it; the message names the key and the fix."""


def check_task(task: fdl.Buildable) -> None:
    """Raise `PreflightError` (or the option errors of `nemo_ckpt.options`) for the first problem of `task`."""
    check_config_options(task)
    for name in ("data",):
        value = _argument(task, name)
        if isinstance(value, fdl.Buildable):
            _build(value, name)


def _argument(task: fdl.Buildable, name: str) -> Any:
    return task.__arguments__.get(name) if isinstance(task, fdl.Buildable) else None


def _build(config: fdl.Buildable, key: str) -> Any:
    try:
        return fdl.build(config)
    except (FileNotFoundError, ValueError, TypeError) as error:
        message = str(error).split("\n\nFiddle context:", 1)[0]  # Fiddle appends the config path it failed at
        raise PreflightError(f"{key}: {message}") from error

"""The run's configuration as YAML in its log directory: what was built, in Hydra's `_target_` style."""

import dataclasses
import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import fiddle as fdl
import lightning.pytorch as pl
import yaml

from nemo_ckpt.checkpoint.context import IOMixin, to_config

TRAINER_SETTINGS = (
    "max_steps",
    "max_epochs",
    "num_nodes",
    "num_devices",
    "precision",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "log_every_n_steps",
    "val_check_interval",
    "limit_val_batches",
    "check_val_every_n_epoch",
)


def target(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def describe(value: Any) -> Any:
    """`value` as plain YAML data: Fiddle configs, IOMixin objects and dataclasses as `{_target_: ..., **arguments}`,
    a Trainer as its main settings, its strategy, callbacks and loggers; other objects as `describe_object`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, fdl.Buildable):
        arguments = {name: describe(arg) for name, arg in fdl.ordered_arguments(value).items()}
        partial = {"_partial_": True} if isinstance(value, fdl.Partial) else {}
        return {"_target_": target(fdl.get_callable(value)), **partial, **arguments}
    if isinstance(value, IOMixin) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return describe(to_config(value))
    if isinstance(value, pl.Trainer):
        return {
            "_target_": target(pl.Trainer),
            **{name: describe(getattr(value, name)) for name in TRAINER_SETTINGS},
            "strategy": describe_object(value.strategy),
            "callbacks": [target(type(callback)) for callback in value.callbacks],
            "loggers": [target(type(logger)) for logger in value.loggers],
        }
    if isinstance(value, Mapping):
        return {str(key): describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    return describe_object(value)


def describe_object(obj: Any) -> dict[str, Any]:
    """An object's class and its public attributes that hold plain values or configs."""
    settings = {
        name: describe(attr)
        for name, attr in vars(obj).items()
        if not name.startswith("_")
        and (attr is None or isinstance(attr, (bool, int, float, str)) or dataclasses.is_dataclass(attr))
    }
    return {"_target_": target(type(obj)), **settings}


def write_run_config(path: Path, description: Mapping[str, Any]) -> None:
    """Write a run's `describe(task_config)` to `path` as YAML."""
    path.write_text(yaml.safe_dump(dict(description), sort_keys=False))

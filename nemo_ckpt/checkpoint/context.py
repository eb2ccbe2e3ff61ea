"""A checkpoint's `context/`: the Fiddle config its model (and data) were built from, so that the checkpoint alone
rebuilds its model, like NeMo's `nemo.lightning.io`.

Classes that inherit `IOMixin` record the arguments each instance is constructed with as `obj.__io__`, a
`fdl.Config` that builds an equal object. `ModelCheckpoint` stores them as `context/<name>.json` (Fiddle's JSON
serialization, the one NeMo-Run uses) in every checkpoint; `load_context` and `load_model` read them back.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

import fiddle as fdl
import lightning.pytorch as pl
from fiddle.experimental import serialization

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.layout import context_dir, weights_dir

MOVED_MODULES = {"nemo_ckpt.models.lightning": "nemo_ckpt.models.gpt.lightning"}  # 0.1.0 -> 0.2.0


def to_config(value: Any) -> Any:
    """`value` as something Fiddle can serialize: IOMixin objects and dataclasses become `fdl.Config`s."""
    if isinstance(value, IOMixin):
        return value.__io__
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        init_fields = (f.name for f in dataclasses.fields(value) if f.init)
        return fdl.Config(type(value), **{name: to_config(getattr(value, name)) for name in init_fields})
    if isinstance(value, (list, tuple)):
        return type(value)(to_config(item) for item in value)
    if isinstance(value, dict):
        return {key: to_config(item) for key, item in value.items()}
    return value


class IOMixin:
    """Record the constructor arguments of every instance as `self.__io__`, a `fdl.Config` of the class."""

    def __new__(cls, *args: Any, **kwargs: Any):
        obj = super().__new__(cls)
        config = fdl.Config(
            cls, *(to_config(arg) for arg in args), **{name: to_config(value) for name, value in kwargs.items()}
        )
        object.__setattr__(obj, "__io__", config)
        return obj


def set_init_arg(obj: Any, name: str, value: Any) -> None:
    """`obj.<name> = value`, recorded in `obj.__io__` too, so the stored config builds what actually ran."""
    setattr(obj, name, value)
    if isinstance(obj, IOMixin):
        setattr(obj.__io__, name, to_config(value))


def save_context(checkpoint: str | Path, **objects: Any) -> list[str]:
    """Write the config of each `IOMixin` object in `objects` to `<checkpoint>/context/<name>.json`; return the
    names written. Objects that did not record their config are skipped."""
    directory = context_dir(checkpoint)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, obj in objects.items():
        if isinstance(obj, IOMixin):
            (directory / f"{name}.json").write_text(serialization.dump_json(obj.__io__))
            written.append(name)
    return written


def load_context(checkpoint: str | Path, name: str = "model") -> fdl.Buildable:
    """The config of `name` ("model" or "data") stored in `checkpoint`; `fdl.build` it to get the object."""
    path = context_dir(checkpoint) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the checkpoint stores no {name} config (its {name} class "
            "must inherit nemo_ckpt.checkpoint.context.IOMixin for ModelCheckpoint to record it)"
        )
    return serialization.load_json(with_current_module_names(path.read_text()))


def with_current_module_names(serialized: str) -> str:
    """A stored config with the modules of classes that moved since it was written (`MOVED_MODULES`) renamed."""
    raw = json.loads(serialized)
    for obj in raw.get("objects", {}).values():
        for entry in [obj.get("type"), *(item[1] for item in obj.get("items", []) if isinstance(item, list))]:
            if isinstance(entry, dict) and entry.get("type") == "pyref" and entry.get("module") in MOVED_MODULES:
                entry["module"] = MOVED_MODULES[entry["module"]]
    return json.dumps(raw)


def load_model(checkpoint: str | Path, load_weights: bool = True) -> pl.LightningModule:
    """Rebuild the model of `checkpoint` from its stored config and, with `load_weights`, load its weights.

    Runs in a single process (no `torch.distributed` needed), whatever the number of ranks that saved it.
    """
    model = fdl.build(load_context(checkpoint, "model"))
    model.configure_model()
    if load_weights:
        tensors = dist_checkpointing.load_plain_tensors(weights_dir(checkpoint))
        model.load_state_dict({key: tensors[key] for key in model.state_dict()})
    return model

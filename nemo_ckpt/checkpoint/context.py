"""A checkpoint's `context/`: the Fiddle config its model (and data) were built from, and its tokenizer
(`context/hf/`, `hf_tokenizer.py`), so that the checkpoint alone rebuilds its model and tokenizes as its training did,
like NeMo's `nemo.lightning.io`.

Classes that inherit `IOMixin` record the arguments each instance is constructed with as `obj.__io__`, a
`fdl.Config` that builds an equal object. `ModelCheckpoint` stores them as `context/<name>.json` (Fiddle's JSON
serialization, the one NeMo-Run uses) in every checkpoint; `load_context` and `load_model` read them back.

Nothing read from disk runs code by default: a stored config may only name classes and functions of `nemo_ckpt`,
`recipes`, Fiddle's config types, torch optimizers, LR schedulers and modules, Lightning's types and plain
builtins (`ALLOWED_ROOTS`, `SAFE_BUILTINS`). Anything else (`subprocess.run`, `os.system`, ...) raises
`UntrustedConfigError` before it is imported; `trust_code=True` lifts the check for checkpoints you trust.
"""

import builtins
import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

import fiddle as fdl
import lightning.pytorch as pl
import torch
from fiddle.experimental import serialization
from torch import nn

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.hf_tokenizer import save_tokenizer
from nemo_ckpt.checkpoint.layout import completion_marker, context_dir, hf_artifacts_dir, is_complete, weights_dir
from nemo_ckpt.data.tokenizer import Tokenizer
from nemo_ckpt.dist_checkpointing.core import fsync_path, write_durably

MOVED_MODULES = {"nemo_ckpt.models.lightning": "nemo_ckpt.models.gpt.lightning"}  # 0.1.0 -> 0.2.0

# Packages whose classes and functions a stored config may name, each with the sub-modules allowed (None: all).
ALLOWED_ROOTS: dict[str, tuple[str, ...] | None] = {
    "nemo_ckpt": None,
    "recipes": None,
    "fiddle": None,
    "torch": ("torch.optim", "torch.nn.modules", "torch.nn.init"),
    "lightning": ("lightning.pytorch", "lightning.fabric"),
}
SAFE_BUILTINS = frozenset(
    {"bool", "bytes", "complex", "dict", "float", "frozenset", "int", "list", "range", "set", "slice", "str", "tuple"}
)


class UntrustedConfigError(ValueError):
    """A stored config names a class or function outside the allow-list."""


class AllowListPyrefPolicy(serialization.PyrefPolicy):
    """Fiddle's import policy for stored configs: only the symbols of `ALLOWED_ROOTS` and `SAFE_BUILTINS`.

    A symbol is checked by name before it is imported, and the imported value again by the module that defines
    it (so `nemo_ckpt.x` re-exporting `subprocess` does not open a way in).
    """

    def allows_import(self, module: str, symbol: str) -> bool:
        if any(part.startswith("__") for part in symbol.split(".")):
            return False
        if module == "builtins":
            return symbol in SAFE_BUILTINS
        return _in_allowed_root(module)

    def allows_value(self, value: Any) -> bool:
        if isinstance(value, enum.Enum):
            value = type(value)
        if not (isinstance(value, type) or callable(value)):
            return False
        module = getattr(value, "__module__", None) or ""
        if module == "builtins":
            return getattr(builtins, getattr(value, "__name__", ""), None) is value and value.__name__ in SAFE_BUILTINS
        return _in_allowed_root(module)

    def __str__(self) -> str:
        return "nemo_ckpt allow-list"


def _in_allowed_root(module: str) -> bool:
    root = module.split(".", 1)[0]
    if root not in ALLOWED_ROOTS:
        return False
    prefixes = ALLOWED_ROOTS[root]
    return prefixes is None or module in prefixes or module.startswith(tuple(f"{p}." for p in prefixes))


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
    """Write the config of each `IOMixin` object in `objects` to `<checkpoint>/context/<name>.json`, and the
    tokenizer of an object that has one (a data module's `tokenizer`) as Hugging Face files to `context/hf/`
    (`hf_tokenizer.save_tokenizer`); return the config names written, fsynced with their directory. Objects that
    did not record their config are skipped."""
    directory = context_dir(checkpoint)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, obj in objects.items():
        if isinstance(obj, IOMixin):
            serialized = serialization.dump_json(obj.__io__).encode()
            write_durably(directory / f"{name}.json", lambda f, data=serialized: f.write(data))
            written.append(name)
        tokenizer = getattr(obj, "tokenizer", None)
        if isinstance(tokenizer, Tokenizer):
            save_tokenizer(tokenizer, hf_artifacts_dir(checkpoint))
    fsync_path(directory)
    return written


def load_context(checkpoint: str | Path, name: str = "model", trust_code: bool = False) -> fdl.Buildable:
    """The config of `name` ("model" or "data") stored in `checkpoint`; `fdl.build` it to get the object.

    The config may only name allow-listed classes and functions (see the module docstring); with `trust_code`,
    any importable symbol (only for checkpoints you trust: building the config runs what it names).
    """
    path = context_dir(checkpoint) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the checkpoint stores no {name} config (its {name} class "
            "must inherit nemo_ckpt.checkpoint.context.IOMixin for ModelCheckpoint to record it)"
        )
    policy = serialization.DefaultPyrefPolicy() if trust_code else AllowListPyrefPolicy()
    try:
        return serialization.load_json(with_current_module_names(path.read_text()), pyref_policy=policy)
    except serialization.PyrefPolicyError as error:
        raise UntrustedConfigError(
            f"{path} names `{error.module}.{error.symbol}`, which is not on nemo_ckpt's allow-list of classes and "
            "functions a stored config may build (nemo_ckpt, recipes, Fiddle, torch optimizers and modules, "
            "Lightning, plain builtins). If you trust this checkpoint, load it with trust_code=True "
            "(load_context / load_model / AutoResume(restore_config_trust_code=True))"
        ) from None


def with_current_module_names(serialized: str) -> str:
    """A stored config with the modules of classes that moved since it was written (`MOVED_MODULES`) renamed."""
    raw = json.loads(serialized)
    for obj in raw.get("objects", {}).values():
        for entry in [obj.get("type"), *(item[1] for item in obj.get("items", []) if isinstance(item, list))]:
            if isinstance(entry, dict) and entry.get("type") == "pyref" and entry.get("module") in MOVED_MODULES:
                entry["module"] = MOVED_MODULES[entry["module"]]
    return json.dumps(raw)


def _read_tensors(checkpoint: str | Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """The whole tensors `keys` of `checkpoint`'s weights (nothing else is read: no optimizer state)."""
    weights = weights_dir(checkpoint)
    metadata = dist_checkpointing.load_tensors_metadata(weights)
    missing = [key for key in keys if key not in metadata]
    if missing:
        raise ValueError(f"{checkpoint} holds no tensors {missing[:8]}: it is not a checkpoint of this model")
    loaded = dist_checkpointing.load({key: metadata[key] for key in keys}, weights, validate_access_integrity=False)
    return {key: loaded[key] for key in keys}


def _adapter_base(checkpoint: str | Path, peft: Any) -> str:
    """The base checkpoint an adapter checkpoint's `peft` (e.g. `LoRA`) names; raises if it is not there."""
    base = getattr(peft, "base_checkpoint", None)
    if base is None:
        raise ValueError(
            f"{checkpoint} holds only {type(peft).__name__} adapters and names no base checkpoint "
            "(peft.base_checkpoint) to load them onto"
        )
    if not is_complete(base):
        raise FileNotFoundError(
            f"{checkpoint} holds only {type(peft).__name__} adapters, for the base checkpoint {base}, which is not a "
            f"complete checkpoint ({completion_marker(base)} is missing): put the base back there to load the model"
        )
    return base


def load_model(checkpoint: str | Path, load_weights: bool = True, trust_code: bool = False) -> pl.LightningModule:
    """Rebuild the model of `checkpoint` from its stored config and, with `load_weights`, load its weights.

    An adapter checkpoint (a model trained with `peft`, e.g. LoRA: it holds only the adapters) loads the weights
    of the base checkpoint its `peft.base_checkpoint` names, then its adapters: the model computes base +
    adapters, as in training (`nemo_ckpt.peft.merge.merge` folds them into one full checkpoint).
    Runs in a single process (no `torch.distributed` needed), whatever the number of ranks that saved it.
    `trust_code`: as in `load_context`.
    """
    model = fdl.build(load_context(checkpoint, "model", trust_code=trust_code))
    model.configure_model()
    if load_weights:
        state = _read_tensors(checkpoint, list(model.state_dict()))
        peft = getattr(model, "peft", None)
        if peft is not None:
            base_keys = [key for key in nn.Module.state_dict(model) if key not in state]
            state |= _read_tensors(_adapter_base(checkpoint, peft), base_keys)
        model.load_state_dict(state)
    return model

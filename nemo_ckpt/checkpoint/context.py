"""A checkpoint's `context/`: the Fiddle config its model (and data) were built from, and its tokenizer
(`context/hf/`, `hf_tokenizer.py`), so that the checkpoint alone rebuilds its model and tokenizes as its training did,
like NeMo's `nemo.lightning.io`.

Classes that inherit `IOMixin` record the arguments each instance is constructed with as `obj.__io__`, a
`fdl.Config` that builds an equal object. `ModelCheckpoint` stores them as `context/<name>.json` (Fiddle's JSON
serialization, the one NeMo-Run uses) in every checkpoint; `load_context` and `load_model` read them back.

A stored config is data, not code: `load_context` reads the JSON itself and builds only `fdl.Config`s of the classes
of `registry.ENTRIES` (the model, its shape, optimizer and adapters), each with its own parameters, holding plain
values or other entries. A config naming anything else (a function, `subprocess.run`, a Fiddle `Partial`, a loader)
or holding anything else raises `UntrustedConfigError`, naming what it found and where, before anything it names is
imported; `trust_code=True` reads it with Fiddle's own loader instead, for checkpoints you trust.
"""

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, NoReturn

import fiddle as fdl
import lightning.pytorch as pl
import torch
from fiddle.experimental import serialization
from torch import nn

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint import registry
from nemo_ckpt.checkpoint.hf_tokenizer import save_tokenizer
from nemo_ckpt.checkpoint.layout import completion_marker, context_dir, hf_artifacts_dir, is_complete, weights_dir
from nemo_ckpt.data.tokenizer import Tokenizer
from nemo_ckpt.dist_checkpointing.core import write_durably
from nemo_ckpt.dist_checkpointing.integrity import read_verified, write_directory_checksums, written_with_checksums

# 0.1.0 -> 0.2.0, for Fiddle's loader (trust_code=True); the registry knows the old names too (Entry.old_modules)
MOVED_MODULES = {"nemo_ckpt.models.lightning": "nemo_ckpt.models.gpt.lightning"}

MAX_CONFIG_BYTES = 4 * 2**20  # a stored model config is a few KiB
MAX_DEPTH = 32  # values and references nested in a stored config (a model's: 7)
FIDDLE_JSON_VERSION = "0.0.1"
_FIDDLE_CONFIG = ("fiddle._src.config", "Config")
_FIDDLE_METADATA = ("fiddle._src.config", "BuildableTraverserMetadata")
_TOP_KEYS = ("root", "objects", "refcounts", "version")
_METADATA_FIELDS = ("fn_or_cls", "argument_names", "argument_tags", "argument_history")
_SEQUENCES = {("builtins", "list"): list, ("builtins", "tuple"): tuple}
_ATTR = re.compile(r"Attr\(name='([A-Za-z_]\w*)'\)")


class UntrustedConfigError(ValueError):
    """A stored config that is not data `load_context` builds: it names something outside `registry.ENTRIES` (a
    function, a Fiddle internal, any other class) or holds something other than plain values and registry configs."""


def _shown(value: Any, limit: int = 200) -> str:
    """`value` for an error message: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key given twice (which JSON readers resolve differently) raises."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise UntrustedConfigError(f"a JSON object repeats the key {_shown(key)}")
        seen.add(key)
    return dict(pairs)


class _ConfigReader:
    """Fiddle's JSON of a config (`serialization.dump_json`) read as data into `fdl.Config`s of registry classes.

    Every object must be reached exactly once from the root (no shared, cyclic or unused objects), every value must
    be a plain JSON value, a list or tuple, or a Fiddle `Config` of a registry class whose metadata carries no tags
    or history; anything else raises `UntrustedConfigError` with its JSON path and config path.
    """

    def __init__(self, source: str, raw: Any, roots: tuple[str, ...]) -> None:
        self.source = source
        self.roots = roots
        if not isinstance(raw, dict) or not {"root", "objects"} <= raw.keys() <= {*_TOP_KEYS}:
            self.refuse("$", "<root>", f"not Fiddle's JSON of a config (a JSON object of {', '.join(_TOP_KEYS)})")
        if raw.get("version", FIDDLE_JSON_VERSION) != FIDDLE_JSON_VERSION:
            self.refuse(
                "$.version", "<root>", f"Fiddle JSON version {_shown(raw['version'])}, not {FIDDLE_JSON_VERSION!r}"
            )
        refcounts = raw.get("refcounts", {})
        if not isinstance(raw["objects"], dict) or not isinstance(refcounts, dict):
            self.refuse("$.objects", "<root>", "objects and refcounts must be JSON objects")
        if not all(key in raw["objects"] and type(count) is int for key, count in refcounts.items()):
            self.refuse("$.refcounts", "<root>", "refcounts must count objects of the file")
        self.objects: dict[str, Any] = raw["objects"]
        self.unread = set(self.objects)
        self.root = raw["root"]

    def refuse(self, at: str, path: str, problem: str) -> NoReturn:
        raise UntrustedConfigError(
            f"{self.source} at {at} ({path}): {problem}. A stored config may only construct "
            f"{', '.join(registry.ENTRIES)} (nemo_ckpt.checkpoint.registry) from plain values; if you trust this "
            "checkpoint, load it with trust_code=True (load_context / load_model / "
            "AutoResume(restore_config_trust_code=True))"
        )

    def read(self) -> fdl.Config:
        config = self.value(self.root, "$.root", "<root>", 0)
        if self.unread:
            self.refuse("$.objects", "<root>", f"objects the config does not use: {sorted(self.unread)[:8]}")
        built = fdl.get_callable(config).__name__ if isinstance(config, fdl.Config) else type(config).__name__
        if built not in self.roots:
            self.refuse("$.root", "<root>", f"a {built}, where this config holds a {' or '.join(self.roots)}")
        return config

    def value(self, value: Any, at: str, path: str, depth: int) -> Any:
        """A plain value, a list or tuple, or a `fdl.Config` of a registry class."""
        if depth > MAX_DEPTH:
            self.refuse(at, path, f"objects nested more than {MAX_DEPTH} deep")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if not isinstance(value, dict):
            self.refuse(at, path, f"a bare JSON {type(value).__name__}, which Fiddle's JSON never holds")
        kind = value.get("type")
        if kind == "leaf":
            self.check_keys(value, {"type", "value"}, {"paths"}, at, path)
            if not (value["value"] is None or isinstance(value["value"], (bool, int, float, str))):
                self.refuse(at, path, f"a leaf holding a JSON {type(value['value']).__name__}, not a plain value")
            return value["value"]
        if kind == "ref":
            self.check_keys(value, {"type", "key"}, set(), at, path)
            key = value["key"]
            if not isinstance(key, str) or key not in self.objects:
                self.refuse(at, path, f"a reference to {_shown(key)}, which is not an object of the file")
            if key not in self.unread:
                self.refuse(at, path, f"a second reference to {_shown(key)} (a shared or cyclic object)")
            self.unread.discard(key)
            return self.value(self.objects[key], f"$.objects[{_shown(key)}]", path, depth + 1)
        if kind == "pyref":
            module, name = self.pyref({k: v for k, v in value.items() if k != "paths"}, at, path)
            self.refuse(
                at, path, f"`{f'{module}.{name}'[:200]}` as a value: a Python symbol (function, class, enum) is code"
            )
        if isinstance(kind, dict):
            return self.object(value, at, path, depth)
        self.refuse(at, path, f"a Fiddle node of type {_shown(kind)}")

    def object(self, obj: dict[str, Any], at: str, path: str, depth: int) -> Any:
        """A Fiddle object (`type`, `items`, `metadata`): a list, a tuple or a `Config` of a registry class."""
        self.check_keys(obj, {"type", "items", "metadata"}, {"paths"}, at, path)
        symbol = self.pyref(obj["type"], f"{at}.type", path)
        items = self.items(obj, at, path)
        if symbol in _SEQUENCES:
            if obj["metadata"] is not None:
                self.refuse(f"{at}.metadata", path, f"metadata of a {symbol[1]}")
            for index, (element, _) in enumerate(items):
                if element != f"Index(index={index})":
                    self.refuse(f"{at}.items[{index}]", path, f"item {_shown(element)} of a {symbol[1]}, not {index}")
            return _SEQUENCES[symbol](
                self.value(item, f"{at}.items[{i}][1]", f"{path}[{i}]", depth + 1) for i, (_, item) in enumerate(items)
            )
        if symbol != _FIDDLE_CONFIG:
            module, name = symbol
            self.refuse(
                f"{at}.type", path, f"an object of `{f'{module}.{name}'[:200]}`; only lists, tuples and fdl.Config"
            )
        entry, argument_names = self.config_metadata(obj["metadata"], f"{at}.metadata", path, depth + 1)
        names = []
        for index, (element, _) in enumerate(items):
            match = _ATTR.fullmatch(element) if isinstance(element, str) else None
            if match is None:
                self.refuse(f"{at}.items[{index}]", path, f"argument {_shown(element)}, not a named argument")
            names.append(match.group(1))
        if names != argument_names:
            self.refuse(
                f"{at}.items", path, f"arguments {_shown(names)}, but its metadata names {_shown(argument_names)}"
            )
        parameters = entry.parameters()
        arguments = {}
        for index, (name, (_, raw)) in enumerate(zip(names, items)):
            if name not in parameters:
                self.refuse(f"{at}.items[{index}]", path, f"{entry.name} has no parameter {name!r}")
            value = self.value(raw, f"{at}.items[{index}][1]", f"{path}.{name}", depth + 1)
            annotation = parameters[name].annotation
            if not registry.accepts(annotation, value):
                self.refuse(
                    f"{at}.items[{index}][1]",
                    f"{path}.{name}",
                    f"{_shown(value)} for {entry.name}.{name}: {annotation}",
                )
            arguments[name] = value
        missing = [name for name, p in parameters.items() if p.default is p.empty and name not in arguments]
        if missing:
            self.refuse(f"{at}.items", path, f"{entry.name} without its required arguments {missing}")
        return fdl.Config(entry.cls, **arguments)

    def config_metadata(self, value: Any, at: str, path: str, depth: int) -> tuple[registry.Entry, list[str]]:
        """The registry entry a `Config`'s metadata names (checked by name, before it is imported) and its argument
        names; its tags and history must be empty."""
        if isinstance(value, dict) and value.get("type") == "ref":
            self.check_keys(value, {"type", "key"}, set(), at, path)
            key = value["key"]
            if not isinstance(key, str) or key not in self.unread:
                self.refuse(at, path, f"a reference to {_shown(key)}, not to an unread object of the file")
            self.unread.discard(key)
            at, value = f"$.objects[{_shown(key)}]", self.objects[key]
        if not isinstance(value, dict):
            self.refuse(at, path, "a Config's metadata must be a Fiddle object")
        self.check_keys(value, {"type", "items", "metadata"}, set(), at, path)
        if self.pyref(value["type"], f"{at}.type", path) != _FIDDLE_METADATA or (
            self.pyref(value["metadata"], f"{at}.metadata", path) != _FIDDLE_METADATA
        ):
            self.refuse(f"{at}.type", path, "a Config's metadata must be a BuildableTraverserMetadata")
        fields = {}
        for index, (element, item) in enumerate(self.items(value, at, path)):
            match = _ATTR.fullmatch(element) if isinstance(element, str) else None
            if match is None or match.group(1) in fields:
                self.refuse(f"{at}.items[{index}]", path, f"metadata item {_shown(element)}")
            fields[match.group(1)] = (item, f"{at}.items[{index}][1]")
        if not {"fn_or_cls", "argument_names"} <= fields.keys() <= {*_METADATA_FIELDS}:
            self.refuse(f"{at}.items", path, f"metadata fields {sorted(fields)}, not {_METADATA_FIELDS}")
        module, name = self.pyref(*fields["fn_or_cls"], path)
        entry = registry.find(module, name)
        if entry is None:
            self.refuse(fields["fn_or_cls"][1], path, f"`{f'{module}.{name}'[:200]}`, which is not in the registry")
        argument_names = self.value(*fields["argument_names"], path, depth + 1)
        if not (isinstance(argument_names, tuple) and all(isinstance(n, str) for n in argument_names)):
            self.refuse(fields["argument_names"][1], path, "argument names must be a tuple of names")
        for extra in ("argument_tags", "argument_history"):
            if extra in fields:
                self.empty_dict(*fields[extra], path)
        return entry, list(argument_names)

    def empty_dict(self, value: Any, at: str, path: str) -> None:
        """Fiddle's JSON of `{}`: the metadata's tags and history, which a stored config must not carry."""
        key = value.get("key") if isinstance(value, dict) and value.get("type") == "ref" else None
        if isinstance(key, str) and key in self.unread:
            self.unread.discard(key)
            at, value = f"$.objects[{_shown(key)}]", self.objects[key]
        empty_tuple = {"type": {"type": "pyref", "module": "builtins", "name": "tuple"}, "items": [], "metadata": None}
        expected = {
            "type": {"type": "pyref", "module": "builtins", "name": "dict"},
            "items": [],
            "metadata": empty_tuple,
        }
        if value != expected:
            self.refuse(at, path, "argument tags or history (Fiddle internals): a stored config holds none")

    def items(self, obj: dict[str, Any], at: str, path: str) -> list[list[Any]]:
        """A Fiddle object's items: [path element, value] pairs."""
        items = obj["items"]
        if not (isinstance(items, list) and all(isinstance(item, list) and len(item) == 2 for item in items)):
            self.refuse(f"{at}.items", path, "items must be [path element, value] pairs")
        return items

    def pyref(self, value: Any, at: str, path: str) -> tuple[str, str]:
        """The (module, name) a Fiddle `pyref` names, as strings: nothing is imported."""
        if not (
            isinstance(value, dict)
            and value.keys() == {"type", "module", "name"}
            and value["type"] == "pyref"
            and isinstance(value["module"], str)
            and isinstance(value["name"], str)
        ):
            self.refuse(at, path, f"{_shown(value)}, not a Fiddle pyref")
        return value["module"], value["name"]

    def check_keys(self, value: dict[str, Any], required: set[str], optional: set[str], at: str, path: str) -> None:
        if not required <= value.keys() <= required | optional:
            self.refuse(at, path, f"a Fiddle node with keys {sorted(value)}, not {sorted(required | optional)}")
        if "paths" in value and not (
            isinstance(value["paths"], list) and all(isinstance(p, str) for p in value["paths"])
        ):
            self.refuse(f"{at}.paths", path, "paths must be a list of strings")


def read_config(serialized: bytes, source: str, roots: tuple[str, ...]) -> fdl.Config:
    """The config Fiddle's JSON `serialized` (read from `source`) describes, read as data (`_ConfigReader`): a
    `fdl.Config` of one of the registry entries `roots`."""
    if len(serialized) > MAX_CONFIG_BYTES:
        raise UntrustedConfigError(f"{source}: {len(serialized)} bytes, more than a stored config ({MAX_CONFIG_BYTES})")
    try:
        raw = json.loads(serialized, object_pairs_hook=_refuse_duplicate_keys)
    except UntrustedConfigError as error:
        raise UntrustedConfigError(f"{source}: {error}") from None
    except (ValueError, RecursionError) as error:  # not UTF-8 or JSON, numbers beyond int's digit limit, too deep
        raise UntrustedConfigError(f"{source}: not a JSON config ({type(error).__name__}: {error})") from None
    return _ConfigReader(source, raw, roots).read()


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
    (`hf_tokenizer.save_tokenizer`), then the CRC32C of every file in `context/checksums.json`; return the config
    names written, fsynced with their directory. Objects that did not record their config are skipped."""
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
    write_directory_checksums(directory)  # fsyncs the directory
    return written


def load_context(checkpoint: str | Path, name: str = "model", trust_code: bool = False) -> fdl.Buildable:
    """The config of `name` stored in `checkpoint` (`context/<name>.json`); `fdl.build` it to get the object.

    Read as data (see the module docstring): `fdl.Config`s of registry classes only, its root one of
    `registry.ROOTS[name]` (a `GPTModel` for "model", the one config checkpoints store), else `UntrustedConfigError`.
    With `trust_code`, Fiddle's own loader reads it and may name any importable symbol (only for checkpoints you
    trust: building the config runs what it names).
    """
    path = context_dir(checkpoint) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the checkpoint stores no {name} config (its {name} class "
            "must inherit nemo_ckpt.checkpoint.context.IOMixin for ModelCheckpoint to record it)"
        )
    required = written_with_checksums(weights_dir(checkpoint))  # a checkpoint of ours that lost them is refused
    raw = read_verified(context_dir(checkpoint), f"{name}.json", required=required)
    if trust_code:
        serialized = with_current_module_names(raw.decode())
        return serialization.load_json(serialized, pyref_policy=serialization.DefaultPyrefPolicy())
    return read_config(raw, str(path), registry.ROOTS.get(name, ()))


def load_model_config(checkpoint: str | Path, trust_code: bool = False) -> fdl.Buildable:
    """The stored config of `checkpoint`'s model (`load_context`), checked to build a LightningModule."""
    config = load_context(checkpoint, "model", trust_code=trust_code)
    built = fdl.get_callable(config) if isinstance(config, fdl.Buildable) else None
    if not (isinstance(config, fdl.Config) and isinstance(built, type) and issubclass(built, pl.LightningModule)):
        raise ValueError(f"{context_dir(checkpoint) / 'model.json'} does not describe a model: it builds {built}")
    return config


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
    model = fdl.build(load_model_config(checkpoint, trust_code))
    model.configure_model()
    if load_weights:
        state = _read_tensors(checkpoint, list(model.state_dict()))
        peft = getattr(model, "peft", None)
        if peft is not None:
            base_keys = [key for key in nn.Module.state_dict(model) if key not in state]
            state |= _read_tensors(_adapter_base(checkpoint, peft), base_keys)
        model.load_state_dict(state)
    return model

"""The registry of what a stored config (`context/*.json`) may construct: the model, its shape, its optimizer and its
adapters, by the name of the module that defines each (and the modules earlier versions defined them in).

A stored config is data: `context.load_context` builds nothing a config names unless its name is found here (before
anything is imported), and gives each entry only its own parameters, holding plain values (`bool`, `int`, `float`,
`str`, `None`, lists and tuples of them) or other entries, as the parameter's annotation says. Constructing an entry
stores its arguments and checks them: no files, network or processes (`tests/checkpoint/test_untrusted_configs.py`
constructs every entry under an audit hook). The classes are imported by name, on first use, so that this module
imports nothing of the packages above `checkpoint`.
"""

import functools
import importlib
import inspect
import operator
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import fiddle as fdl


@dataclass(frozen=True)
class Entry:
    """A class a stored config may construct: defined as `name` in `module`, named by configs of earlier versions
    after one of `old_modules` too. `takes`: the entries (None: `None`) a parameter annotated `Any` may hold."""

    module: str
    name: str
    old_modules: tuple[str, ...] = ()
    takes: Mapping[str, tuple[str | None, ...]] = field(default_factory=dict)

    @property
    def cls(self) -> type:
        return _import(self.module, self.name)

    def parameters(self) -> dict[str, inspect.Parameter]:
        """The constructor's parameters, by name, each with its annotation (`takes` resolved into one)."""
        return _parameters(self.module, self.name)


ENTRIES: dict[str, Entry] = {
    "GPTModel": Entry(
        "nemo_ckpt.models.gpt.lightning", "GPTModel", ("nemo_ckpt.models.lightning",), {"peft": ("LoRA", None)}
    ),
    "GPTConfig": Entry("nemo_ckpt.models.gpt.model", "GPTConfig", ("nemo_ckpt.models.gpt",)),
    "OptimizerConfig": Entry("nemo_ckpt.optim", "OptimizerConfig"),
    "LoRA": Entry("nemo_ckpt.peft.lora", "LoRA"),
}

# The entries each stored config (`context/<name>.json`) may hold at its root.
ROOTS: dict[str, tuple[str, ...]] = {"model": ("GPTModel",)}

_BY_STORED_NAME = {
    f"{module}.{entry.name}": entry for entry in ENTRIES.values() for module in (entry.module, *entry.old_modules)
}


def find(module: str, name: str) -> Entry | None:
    """The entry a stored config names `module`.`name` by (as Fiddle's JSON does), or None: nothing is imported."""
    return _BY_STORED_NAME.get(f"{module}.{name}")


@functools.cache
def _import(module: str, name: str) -> type:
    cls = getattr(importlib.import_module(module), name)
    if not isinstance(cls, type):
        raise TypeError(f"the registry names {module}.{name}, which is not a class")
    return cls


@functools.cache
def _parameters(module: str, name: str) -> dict[str, inspect.Parameter]:
    entry = _BY_STORED_NAME[f"{module}.{name}"]
    signature = inspect.signature(entry.cls.__init__, eval_str=True)
    parameters = {}
    for parameter in list(signature.parameters.values())[1:]:  # without `self`
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            continue  # *args, **kwargs: a config names every argument it sets
        if parameter.name in entry.takes:
            held = [type(None) if taken is None else ENTRIES[taken].cls for taken in entry.takes[parameter.name]]
            parameter = parameter.replace(annotation=functools.reduce(operator.or_, held))
        parameters[parameter.name] = parameter
    return parameters


def accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` (a plain value, a list or tuple, or a `fdl.Config` of an entry) is one `annotation` describes;
    annotations other than plain types, sequences of them, unions and entry classes accept nothing."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(accepts(arg, value) for arg in args)
    if origin in (list, tuple):
        item = args[0] if args and (origin is list or args[1:] == (...,)) else None
        return isinstance(value, (list, tuple)) and item is not None and all(accepts(item, v) for v in value)
    if isinstance(value, fdl.Config):
        return isinstance(annotation, type) and issubclass(fdl.get_callable(value), annotation)
    if annotation is float:
        return type(value) in (int, float)
    return annotation in (bool, int, str, type(None)) and type(value) is annotation

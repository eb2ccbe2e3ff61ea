"""Strict options: a class or function accepts only the arguments it declares.

A misspelt option is an error naming the closest declared one ("unknown option `ckpt_async_sav`; did you mean
`ckpt_async_save`?"); a NeMo option this package does not implement is an error saying what it means in NeMo.
`strict_options` adds both to a class's constructor without changing its signature, so Fiddle and NeMo-Run still
check names against it when a config is built (`run.Config(MegatronStrategy, ckpt_async_sav=True)` fails there).
`flat_options` lets a constructor take the fields of option dataclasses as its own flat keyword arguments,
declared once in the dataclass. `check_config_options` walks a whole Fiddle config and reports its first unknown
argument the same way; `check_override` checks one command-line override (`trainer.strategy.ckpt_async_sav=True`)
against a config.
"""

import dataclasses
import difflib
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import fiddle as fdl

T = TypeVar("T", bound=type)


class UnknownOptionError(TypeError):
    """An argument that the class or function does not declare."""


class UnsupportedOptionError(ValueError):
    """A NeMo / Megatron-Core option that this package does not implement."""


def unknown_option_message(owner: str, name: str, known: Iterable[str]) -> str:
    """ "<owner>: unknown option `name`; did you mean `closest`?" (the suggestion only when one is close)."""
    matches = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    suggestion = f"; did you mean `{matches[0]}`?" if matches else ""
    return f"{owner}: unknown option `{name}`{suggestion}"


def declared_options(fn_or_cls: Callable[..., Any]) -> list[str]:
    """The argument names `fn_or_cls` takes by keyword."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [name for name, p in inspect.signature(fn_or_cls).parameters.items() if p.kind in kinds]


def check_options(
    owner: str, given: Iterable[str], known: Iterable[str], unsupported: Mapping[str, str] | None = None
) -> None:
    """Raise for the first name in `given` that is in `unsupported` (name -> its NeMo meaning) or not `known`."""
    known = list(known)
    for name in given:
        if unsupported and name in unsupported:
            raise UnsupportedOptionError(f"{owner}: not supported: {name} (NeMo meaning: {unsupported[name]})")
        if name not in known:
            raise UnknownOptionError(unknown_option_message(owner, name, known))


def strict_options(unsupported: Mapping[str, str] | None = None) -> Callable[[T], T]:
    """Class decorator: the constructor refuses undeclared keyword arguments with a suggestion, and the names of
    `unsupported` (name -> what it means in NeMo) with that meaning. The signature seen by `inspect` (and so by
    Fiddle) stays the declared one."""

    def decorate(cls: T) -> T:
        init = cls.__init__
        known = declared_options(cls)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            check_options(type(self).__name__, kwargs, known, unsupported)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.unsupported_options = dict(unsupported or {})
        return cls

    return decorate


def flat_options(*declarations: type) -> Callable[[T], T]:
    """Class decorator: the constructor's `**options` are the fields of the dataclasses `declarations`, declared
    there once with their types and defaults (fields the constructor declares itself, or that are not init
    arguments, excepted). The constructor's signature (as `inspect`, Fiddle, NeMo-Run and `strict_options` see
    it) lists them as keyword-only arguments after its own; apply `strict_options` on top."""

    def decorate(cls: T) -> T:
        own = inspect.signature(cls.__init__)
        parameters = [p for p in own.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
        for declaration in declarations:
            types = typing.get_type_hints(declaration)
            parameters += [
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=types[f.name])
                for f in dataclasses.fields(declaration)
                if f.init and f.name not in own.parameters
            ]
        cls.__init__.__signature__ = own.replace(parameters=parameters)
        return cls

    return decorate


def check_config_options(config: fdl.Buildable) -> None:
    """Raise `UnknownOptionError` / `UnsupportedOptionError` for the first argument of `config` (or of a config
    nested in it) that its class or function does not declare, naming its path in the config.

    Fiddle refuses such names when they are set, unless the target takes `**kwargs`; this also covers those.
    """
    for path, buildable in _buildables(config, "config"):
        target = fdl.get_callable(buildable)
        try:
            parameters = inspect.signature(target).parameters
        except (TypeError, ValueError):
            continue
        takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        unsupported = getattr(target, "unsupported_options", None)
        given = [name for name in buildable.__arguments__ if isinstance(name, str)]
        if unsupported or not takes_kwargs:
            check_options(path, given, declared_options(target), unsupported)


def check_override(config: fdl.Buildable, key: str) -> None:
    """Raise `UnknownOptionError` / `UnsupportedOptionError` if the dotted `key` of a command-line override
    (`trainer.strategy.ckpt_async_sav`) names an argument that its target does not declare.

    Keys that do not lead through `config`'s nested configs (e.g. `run.executor...`) are left to their owner.
    """
    *parents, name = key.split(".")
    target = config
    for part in parents:
        target = getattr(target, part, None) if isinstance(target, fdl.Buildable) else None
    if not isinstance(target, fdl.Buildable):
        return
    fn_or_cls = fdl.get_callable(target)
    parameters = inspect.signature(fn_or_cls).parameters
    takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    unsupported = getattr(fn_or_cls, "unsupported_options", None)
    if unsupported or not takes_kwargs:
        owner = ".".join(parents) or getattr(fn_or_cls, "__name__", str(fn_or_cls))
        check_options(owner, [name], declared_options(fn_or_cls), unsupported)


def _buildables(value: Any, path: str) -> Iterable[tuple[str, fdl.Buildable]]:
    if isinstance(value, fdl.Buildable):
        yield path, value
        for name, child in value.__arguments__.items():
            yield from _buildables(child, f"{path}.{name}")
    elif isinstance(value, (list, tuple)):
        for index, child in enumerate(value):
            yield from _buildables(child, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, child in value.items():
            yield from _buildables(child, f"{path}[{key!r}]")

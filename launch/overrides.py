"""Command-line values as Python takes them: a list or dict written for an option whose type allows one is one.

NeMo-Run parses `key=value` by the option's annotation, and a union (`str | Path | Sequence | dict`) by its first
member that accepts the value: `str` accepts anything, so `data.paths=['/a','/b']` arrived as one string. Here a
value written as a list (`[...]`) or dict (`{...}`) for a PEP 604 union with a sequence or mapping member is parsed
as one first; other values go to NeMo-Run's union parser unchanged. List items may be Python literals (`0.3`, `'/a'`)
or bare words (`/a`, what is left of `'/a'` once the shell has removed its quotes): `data.paths=[0.3,/a,0.7,/b]` and
`"data.paths=[0.3, '/a', 0.7, '/b']"` are both `[0.3, '/a', 0.7, '/b']`. A bare word that reads as a number is one:
quote a path such as `2024` (`"data.paths=['2024']"`). Unions written with `typing.Union` keep NeMo-Run's parsing
(it dispatches those before any registered parser).
"""

import ast
import collections.abc
from collections.abc import Callable
from typing import Any, get_args, get_origin

from nemo_ckpt._compat import nemo_run_cli_parse_union_types_with

_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _unquoted(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1].strip()
    return value


def _item(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_list(value: str) -> list[Any] | None:
    """`value` as a list if it is written as one (`[0.3, /a, 0.7, /b]`, `['/a', '/b']`), else None."""
    value = _unquoted(value)
    if not (value.startswith("[") and value.endswith("]")):
        return None
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        inner = value[1:-1]
        if any(bracket in inner for bracket in "[]{}()"):
            return None
        items = [item.strip() for item in inner.split(",")]
        if items and items[-1] == "":  # a trailing comma, as Python allows
            items.pop()
        if "" in items:
            return None
        return [_item(item) for item in items]
    return list(parsed) if isinstance(parsed, (list, tuple)) else None


def parse_dict(value: str) -> dict[Any, Any] | None:
    """`value` as a dict if it is a Python dict literal (`{'train': ['/a'], 'validation': ['/b']}`), else None."""
    value = _unquoted(value)
    if not (value.startswith("{") and value.endswith("}")):
        return None
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    return parsed if isinstance(parsed, dict) else None


def parse_union(value: str, annotation: Any, parse_union: Callable[[str, Any], Any]) -> Any:
    """A list or dict where `annotation` (a union) has such a member and `value` is written as one; otherwise what
    `parse_union` (NeMo-Run's union parser) makes of it."""
    members = [get_origin(member) or member for member in get_args(annotation)]
    if any(member in _SEQUENCES for member in members) and (parsed := parse_list(value)) is not None:
        return parsed
    if any(member in _MAPPINGS for member in members) and (parsed := parse_dict(value)) is not None:
        return parsed
    return parse_union(value, annotation)


def register() -> None:
    """Make NeMo-Run's command line parse PEP 604 unions with `parse_union` (NeMo-Run 0.11 knows only
    `typing.Union`: without this, `int | None` options such as `log.ckpt.every_n_train_steps=5` do not parse)."""
    nemo_run_cli_parse_union_types_with(parse_union)

"""Utilities for nested dicts and lists (the containers of a sharded state dict).

Everything that is not a dict or a list is a leaf (tuples included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

Nested = dict | list


def nested_values(x: Nested) -> Iterator[Any]:
    """Yield the leaves of a nested dict/list."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[tuple[Nested, Any, Any]]:
    """Yield `(container, key, leaf)` for every leaf of a nested dict/list."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Replace every leaf `v` of `x` with `f(v)` in place; returns `x` (or `f(x)` for a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Like `dict_list_map_inplace` but builds new containers."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[Nested, Nested]:
    """Split `x` into (matching, non-matching) leaves, keeping the hierarchy.

    With `return_lists_as_dicts` lists become `{index: value}` dicts so that the
    original positions can be restored by `merge`.
    """

    def put(target: Nested, k: Any, v: Any) -> None:
        if isinstance(target, dict):
            target[k] = v
        else:
            target.append(v)

    if isinstance(x, dict):
        matching, rest = {}, {}
        items = x.items()
    elif isinstance(x, list):
        matching, rest = ({}, {}) if return_lists_as_dicts else ([], [])
        items = enumerate(x)
    else:
        raise ValueError(f"Unexpected top-level object type: {type(x)}")
    for k, v in items:
        if isinstance(v, (dict, list)) and v:
            sub_match, sub_rest = extract_matching_values(v, predicate, return_lists_as_dicts)
            if sub_match:
                put(matching, k, sub_match)
            if sub_rest:
                put(rest, k, sub_rest)
        elif isinstance(v, (dict, list)):
            put(rest, k, v)  # keep empty containers on the non-matching side
        else:
            put(matching if predicate(v) else rest, k, v)
    return matching, rest


def merge(x1: Nested, x2: Nested, key: tuple = (), merge_leaf: Callable[[Any, Any], Any] | None = None) -> Nested:
    """Merge `x2` into `x1` recursively (in place). Lists merge element-wise; a dict with
    int keys merges into a list at those positions.

    Without `merge_leaf`, keys of `x2` missing from `x1` are added and two values that are
    not containers clash. With it, every `x2` value that is not a container replaces the value
    at its place in `x1` by `merge_leaf(x1_value, x2_value)`, and `x2` may only name
    places that `x1` has.
    """
    if merge_leaf is not None and not isinstance(x2, (dict, list)):
        return merge_leaf(x1, x2)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k in x1:
                x1[k] = merge(x1[k], v2, key + (k,), merge_leaf)
            elif merge_leaf is None:
                x1[k] = v2
            else:
                raise ValueError(f"Key {k!r} is missing from the state dict merged into at {key}")
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"Cannot merge lists of lengths {len(x1)} and {len(x2)} at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,), merge_leaf)
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or k >= len(x1):
                raise ValueError(f"Invalid list index {k!r} for a list of length {len(x1)} at {key}")
            x1[k] = merge(x1[k], v2, key + (k,), merge_leaf)
    else:
        raise ValueError(f"Duplicate non-container values at {key}: {type(x1)} and {type(x2)}")
    return x1


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Recursive diff: (prefixes only in x1, prefixes only in x2, mismatching prefixes)."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        mismatch: list = []
        for k in x1.keys() & x2.keys():
            left, right, mis = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += mis
        return only_left, only_right, mismatch
    if isinstance(x1, (list, tuple)) and type(x1) is type(x2):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        mismatch = []
        for i, (v1, v2) in enumerate(zip(x1, x2)):
            left, right, mis = diff(v1, v2, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += mis
        return only_left, only_right, mismatch
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        same = x1.shape == x2.shape and x1.dtype == x2.dtype and bool(torch.equal(x1.cpu(), x2.cpu()))
    else:
        try:
            same = type(x1) is type(x2) and bool(x1 == x2)
        except (RuntimeError, TypeError, ValueError):
            same = False
    return [], [], [] if same else [(prefix, type(x1), type(x2))]

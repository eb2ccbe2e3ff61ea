"""Loading pickled checkpoint content without running arbitrary code.

Common data (`common.pt`), ShardedObjects and DCP's `.metadata` are pickles. They
are read with `torch.load(weights_only=True)` (or a restricted unpickler for
`.metadata`) plus an allow-list of harmless types. A refused type raises
`UnsafeCheckpointError` naming it; trusted checkpoints can be read with
`allow_unsafe_pickle=True` and extra types can be allowed with `register_safe_globals`.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

import numpy
import torch
from torch.distributed.checkpoint.metadata import Metadata

from .._compat import numpy_array_reconstructor
from .core import CheckpointingException


class UnsafeCheckpointError(CheckpointingException):
    """A checkpoint holds a pickled type that is not on the allow-list."""


def _numpy_globals() -> list[Any]:
    dtype_classes = [getattr(numpy.dtypes, n) for n in dir(numpy.dtypes) if n.endswith("DType")]
    return [numpy_array_reconstructor(), numpy.ndarray, numpy.dtype, *dtype_classes]


# Types that are safe to rebuild: plain data holders found in Megatron/NeMo common state.
SAFE_GLOBALS: list[Any] = [
    argparse.Namespace,
    types.SimpleNamespace,
    pathlib.PosixPath,
    pathlib.PurePosixPath,
    io.BytesIO,
    *_numpy_globals(),
]


def register_safe_globals(extra: Iterable[Any]) -> None:
    """Allow more types (classes or functions) when loading common data and ShardedObjects."""
    for obj in extra:
        if obj not in SAFE_GLOBALS:
            SAFE_GLOBALS.append(obj)


_REFUSED_RE = re.compile(r"GLOBAL ([\w.]+)|global '?([\w.]+)'?")


def _refused_name(err: Exception) -> str:
    match = _REFUSED_RE.search(str(err))
    return next((g for g in match.groups() if g), "?") if match else "?"


def safe_torch_load(f: str | IO[bytes], where: str, allow_unsafe_pickle: bool = False) -> Any:
    """`torch.load` restricted to tensors, builtins and `SAFE_GLOBALS`.

    `where` names the file and key for error messages.
    """
    if allow_unsafe_pickle:
        return torch.load(f, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"Refused to unpickle type '{_refused_name(e)}' from {where}: loading it could run "
            f"arbitrary code. If you trust this checkpoint, pass allow_unsafe_pickle=True, or allow "
            f"the type with nemo_ckpt.dist_checkpointing.safe_globals.register_safe_globals([...])."
        ) from e
    except Exception as e:  # a damaged zip or pickle: torch raises EOFError, RuntimeError, MemoryError, ...
        raise CheckpointingException(
            f"{where} is corrupt: {type(e).__name__}: {e}; `python -m nemo_ckpt verify` names the damaged file"
        ) from e


@dataclass
class LegacyMCoreMetadata(Metadata):
    """DCP metadata written by Megatron-Core <= 0.18 (its `MCoreMetadata`): `mcore_data[key]` holds
    `nd_reformulated_orig_global_shape` for each flattened-range tensor stored in its reformulated layout."""

    mcore_data: dict[str, dict[str, Any]] | None = None


class _LegacyMCorePlaceholder:
    """Stands in for Megatron-Core classes pickled into old DCP `.metadata` files (`MCoreSavePlan`)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
        "LoadPlan",
        "ReadItem",
        "LoadItemType",
    },
}
_PLAIN_CLASSES = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
}
_LEGACY_MCORE = {"MCoreMetadata": LegacyMCoreMetadata, "MCoreSavePlan": _LegacyMCorePlaceholder}


class DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickler for DCP `.metadata` that only rebuilds DCP metadata classes and torch enums."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()) or (module, name) in _PLAIN_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        if module.startswith("megatron.core.dist_checkpointing") and name in _LEGACY_MCORE:
            return _LEGACY_MCORE[name]
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")

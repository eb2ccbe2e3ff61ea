"""The default strategy of each checkpoint format, dispatched by its name and version.

Megatron-Core kept a global registry that strategy modules filled on import (deprecated in 0.19,
removed in 0.20); here each format maps to its class directly. A format of your own is saved and
loaded by passing your strategy object to `save`/`load`.
"""

from __future__ import annotations

from typing import Any

from ..core import CheckpointingException
from .base import LoadCommonStrategy, LoadShardedStrategy, SaveCommonStrategy, SaveShardedStrategy
from .common import TorchCommonLoadStrategy, TorchCommonSaveStrategy
from .torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from .zarr import ZarrLoadShardedStrategy

SAVE_SHARDED = {("torch_dist", 1): TorchDistSaveShardedStrategy}
SAVE_COMMON = {("torch", 1): TorchCommonSaveStrategy}
LOAD_SHARDED = {("torch_dist", 1): TorchDistLoadShardedStrategy, ("zarr", 1): ZarrLoadShardedStrategy}
LOAD_COMMON = {("torch", 1): TorchCommonLoadStrategy}


def _lookup(formats: dict[tuple[str, int], type], action: str, backend: str, version: int) -> type:
    try:
        return formats[(backend, version)]
    except KeyError:
        raise CheckpointingException(
            f"Cannot find a default strategy for: {(action, backend, version)}. Known (backend, version) pairs for "
            f"{action}: {sorted(formats)}; pass a strategy object to save/load for another format"
        ) from None


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    """A new save strategy writing `backend` (format `version`)."""
    return _lookup(SAVE_SHARDED, "save_sharded", backend, version)(backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    """A new common save strategy writing `backend` (format `version`)."""
    return _lookup(SAVE_COMMON, "save_common", backend, version)(backend, version)


def default_load_sharded_strategy(backend: str, version: int = 1, **options: Any) -> LoadShardedStrategy:
    """A new load strategy reading `backend` (format `version`), built with `options`
    (`load_directly_on_device`, ...)."""
    return _lookup(LOAD_SHARDED, "load_sharded", backend, version)(**options)


def default_load_common_strategy(backend: str = "torch", version: int = 1) -> LoadCommonStrategy:
    """A new common load strategy reading `backend` (format `version`)."""
    return _lookup(LOAD_COMMON, "load_common", backend, version)()

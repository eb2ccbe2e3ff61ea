"""Strategy interfaces and the default-strategy registry keyed by (backend, version).

A save strategy writes one checkpoint format (``backend``, ``version``, recorded in
``metadata.json``); a load strategy reads it. Wrappers (fully parallel, async, ...)
change how the work is done, never the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Any

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, StateDict


class StrategyAction(Enum):
    """Which of the four strategy kinds a registry entry is."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


default_strategies: dict[str, dict[tuple[str, int], Any]] = defaultdict(dict)


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy: Any) -> None:
    """Make ``strategy`` the default for ``action`` on (backend, version)."""
    default_strategies[action.value][(backend, version)] = strategy


def _register_builtin_strategies() -> None:
    from . import common, torch, zarr  # noqa: F401  (modules register themselves on import)


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The registered default strategy for ``action`` on (backend, version)."""
    _register_builtin_strategies()
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError as e:
        known = sorted(default_strategies[action.value])
        raise CheckpointingException(
            f"Cannot find a default strategy for: {(action.value, backend, version)}. "
            f"Known (backend, version) pairs for {action.value}: {known}"
        ) from e


class LoadStrategyBase(ABC):
    """Base of load strategies."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise CheckpointingException if this strategy cannot read ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise CheckpointingException if this strategy cannot read ``loaded_version``."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """True if ShardedObjects are loaded by this (sharded) strategy."""
        return False


class SaveStrategyBase(ABC):
    """Base of save strategies: one (backend, version) format."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """True if ShardedObjects are saved by this (sharded) strategy."""
        return False

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (rank-0, non-sharded) part of a checkpoint."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Path) -> StateDict:
        """Load the common state dict."""

    @abstractmethod
    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """Load ShardedObjects (when the sharded strategy cannot)."""

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """ShardedObjects stored by this strategy, as metadata-only objects."""
        return {}


class LoadShardedStrategy(LoadStrategyBase):
    """Loads ShardedTensors (and possibly ShardedObjects)."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """Load the requested shards; returns the state dict with data in place of sharded entities."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """``{key: ShardedTensor without data}`` with the full global shape of every stored tensor."""

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """Like :meth:`load_tensors_metadata` but also ShardedObjects (keyed by unique key)."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(f"{self.__class__.__name__} must implement load_sharded_metadata")


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common part of a checkpoint (rank 0)."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        """Save the common state dict."""

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Save ShardedObjects (when the sharded strategy cannot)."""
        raise NotImplementedError(f"{self.__class__.__name__} cannot save ShardedObjects")


class SaveShardedStrategy(SaveStrategyBase):
    """Saves ShardedTensors (and possibly ShardedObjects). Collective over all ranks."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Save the main replicas of all shards in ``sharded_state_dict``."""

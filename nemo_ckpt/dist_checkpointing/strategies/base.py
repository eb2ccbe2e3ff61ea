"""Strategy interfaces.

A save strategy writes one checkpoint format (`backend`, `version`, recorded in
`metadata.json`); a load strategy reads it. Wrappers (fully parallel, async, ...)
change how the work is done, never the format. `.defaults` picks the strategy of a
format by its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, StateDict


def load_device(load_directly_on_device: bool) -> torch.device:
    """Where loaded tensors without a destination go: the current accelerator if asked and present, else CPU."""
    accelerator = torch.accelerator.current_accelerator() if load_directly_on_device else None
    return accelerator if accelerator is not None else torch.device("cpu")


class LoadStrategyBase(ABC):
    """Base of load strategies: each reads the format named `backend` in the `supported_versions`."""

    backend: str
    supported_versions: tuple[int, ...] = (1,)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise CheckpointingException if this strategy cannot read `loaded_backend`."""
        if loaded_backend != self.backend:
            raise CheckpointingException(f"{self.__class__.__name__} cannot load backend '{loaded_backend}'")

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise CheckpointingException if this strategy cannot read `loaded_version`."""
        if loaded_version not in self.supported_versions:
            raise CheckpointingException(
                f"{self.__class__.__name__} cannot load {self.backend} version {loaded_version}"
            )

    @property
    def can_handle_sharded_objects(self) -> bool:
        """True if ShardedObjects are loaded by this (sharded) strategy."""
        return False


class SaveStrategyBase:
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
        """`{key: ShardedTensor without data}` with the full global shape of every stored tensor."""

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """Like `load_tensors_metadata` but also ShardedObjects (keyed by unique key)."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(f"{self.__class__.__name__} must implement load_sharded_metadata")


class SaveCommonStrategy(SaveStrategyBase, ABC):
    """Saves the common part of a checkpoint (rank 0)."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        """Save the common state dict."""

    def save_common_async(self, common_state_dict: StateDict, checkpoint_dir: Path) -> Callable[[], None]:
        """For an async save: do now what cannot wait (the state may change once the call returns) and return
        the function that finishes the save in the background. By default all of it is done now."""
        self.save_common(common_state_dict, checkpoint_dir)
        return lambda: None

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Save ShardedObjects (when the sharded strategy cannot)."""
        raise NotImplementedError(f"{self.__class__.__name__} cannot save ShardedObjects")


class SaveShardedStrategy(SaveStrategyBase, ABC):
    """Saves ShardedTensors (and possibly ShardedObjects). Collective over all ranks."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Save the main replicas of all shards in `sharded_state_dict`."""

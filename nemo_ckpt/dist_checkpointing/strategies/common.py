"""The `torch` common backend: rank 0's common state dict in `common.pt`."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..core import CheckpointingException, fsync_path, write_durably
from ..dict_utils import dict_list_map_outplace, nested_values
from ..integrity import read_verified
from ..mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from ..safe_globals import UnsafeCheckpointError, safe_torch_load
from ..utils import get_rank
from .base import LoadCommonStrategy, SaveCommonStrategy
from .torch import load_common_state_object

COMMON_STATE_FNAME = "common.pt"


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Rank 0 writes the common state dict to `common.pt`; ShardedObjects (if this
    strategy handles them) go to `<key>/shard_<offsets>_<shape>.pt`."""

    def __init__(self, backend: str = "torch", version: int = 1) -> None:
        super().__init__(backend, version)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        if get_rank() == 0:
            write_durably(os.path.join(checkpoint_dir, COMMON_STATE_FNAME), lambda f: torch.save(common_state_dict, f))

    def save_common_async(self, common_state_dict: StateDict, checkpoint_dir: Path) -> Callable[[], None]:
        """Serialize now, in memory; write and fsync `common.pt` in the background (no disk wait in training)."""
        if get_rank() != 0:
            return lambda: None
        serialized = io.BytesIO()
        torch.save(common_state_dict, serialized)
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        return lambda: write_durably(path, lambda f: f.write(serialized.getbuffer()))

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        for sh_obj in nested_values(sharded_objects_state_dict):
            if is_main_replica(sh_obj.replica_id):
                path = os.path.join(checkpoint_dir, sh_obj.unique_key + ".pt")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_durably(path, lambda f, data=sh_obj.data: torch.save(data, f))
                fsync_path(os.path.dirname(path))


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads `common.pt` (or, for checkpoints without it, the `common_state` object that
    Megatron-Core >= 0.19 stores in the torch_dist data) with the safe unpickler, checked against its checksum
    first (`verify_checksums`)."""

    backend = "torch"

    def __init__(self, allow_unsafe_pickle: bool = False, verify_checksums: bool = True) -> None:
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.verify_checksums = verify_checksums

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        if os.path.isfile(path):
            data = read_verified(checkpoint_dir, COMMON_STATE_FNAME, self.verify_checksums)
            return safe_torch_load(io.BytesIO(data), f"common state file {path}", self.allow_unsafe_pickle)
        try:
            return load_common_state_object(Path(checkpoint_dir), self.allow_unsafe_pickle, self.verify_checksums)
        except UnsafeCheckpointError:
            raise
        except CheckpointingException as e:
            raise CheckpointingException(
                f"No common state in {checkpoint_dir}: {COMMON_STATE_FNAME} is missing ({e})"
            ) from e

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        def load_one(sh_obj: Any) -> Any:
            path = os.path.join(checkpoint_dir, sh_obj.unique_key + ".pt")
            if not os.path.isfile(path):
                raise CheckpointingException(f"ShardedObject '{sh_obj.unique_key}' file {path} does not exist")
            return safe_torch_load(path, f"ShardedObject '{sh_obj.unique_key}' ({path})", self.allow_unsafe_pickle)

        return dict_list_map_outplace(load_one, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        sharded_metadata: ShardedStateDict = {}
        for dirpath, _, filenames in os.walk(checkpoint_dir):
            for name in filenames:
                if name.startswith("shard_") and name.endswith(".pt"):
                    rel_key = os.path.relpath(os.path.join(dirpath, name[: -len(".pt")]), checkpoint_dir)
                    sh_obj = ShardedObject.empty_from_unique_key(rel_key)
                    sharded_metadata[sh_obj.unique_key] = sh_obj
        return sharded_metadata

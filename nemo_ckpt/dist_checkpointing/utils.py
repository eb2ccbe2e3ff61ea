"""Process helpers, splitting sharded state dicts by entity type and renaming sharded keys."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, extract_matching_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)


def dist_ready() -> bool:
    """Whether torch.distributed runs (else: one process)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank; 0 without torch.distributed."""
    return dist.get_rank() if dist_ready() else 0


def get_world_size() -> int:
    """The number of processes; 1 without torch.distributed."""
    return dist.get_world_size() if dist_ready() else 1


def barrier() -> None:
    """A barrier over all ranks; nothing without torch.distributed."""
    if dist_ready():
        dist.barrier()


def raise_on_every_rank(error: Exception | None, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group`: if `error` happened on any rank, raise on every rank (it on the ranks where it
    happened, a `CheckpointingException` naming the first failed rank and its error on the others), so that no
    rank goes on to a collective its peers never reach."""
    if not dist_ready() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    failures: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(rank, failure) for rank, failure in enumerate(failures) if failure is not None]
    if failed:
        rank, failure = failed[0]
        raise CheckpointingException(f"{what} failed on rank {rank} of its group ({len(failed)} failed): {failure}")


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(ShardedTensors, everything else), keeping the hierarchy."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(ShardedTensors and ShardedTensorFactories, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory)))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """(ShardedTensors, factories and LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory)),
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(ShardedBase objects, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """(LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend `prefix` to the key of every ShardedBase, in place."""

    def add_prefix(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace `old_prefix` with `new_prefix` in every ShardedBase key, in place.

    Raises ValueError if a key does not start with `old_prefix`.
    """

    def replace_prefix(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"Expected {x.key} to begin with prefix {old_prefix}")
            x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Replace the first matching prefix of every ShardedBase key per `prefix_map`, in place."""

    def replace_prefixes(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            for old_prefix, new_prefix in prefix_map.items():
                if x.key.startswith(old_prefix):
                    x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
                    break
        return x

    dict_list_map_inplace(replace_prefixes, sharded_state_dict)

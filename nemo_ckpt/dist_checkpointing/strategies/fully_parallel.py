"""Fully parallel save and load: wrappers that spread the work over a process group, format unchanged.

Save: every shard held by several ranks (data-parallel replicas) is written once, by one of its
holders, chosen so that each rank of the parallelization group writes about the same number of
bytes. Load: each shard needed by several ranks is read from storage once, by one of them, and
broadcast to the others over the group (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace, nested_values
from ..exchange_utils import ShardId, broadcast_shards, distribute_shards, group_ranks, shard_id, shard_nbytes
from ..mapping import ShardedBase, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..utils import raise_on_every_rank
from .async_utils import AsyncRequest
from .base import LoadShardedStrategy, SaveShardedStrategy

ShardDistribution = dict[ShardId, int]


def _gather_in_group(local: object, group: dist.ProcessGroup | None) -> list:
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return gathered


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    group: dist.ProcessGroup | None = None,
    include: Callable[[ShardedBase], bool] | None = None,
) -> ShardDistribution:
    """Collective over `group`: which rank writes each shard this group is responsible for.

    The group saves a shard if one of its ranks holds the main replica; it is then written by the
    least loaded of the group's ranks that hold a copy. Shards `include` rejects are left out.
    """
    local = [
        (shard_id(sh), shard_nbytes(sh), is_main_replica(sh.replica_id))
        for sh in nested_values(sharded_state_dict)
        if include is None or include(sh)
    ]
    holders: dict[ShardId, list[int]] = {}
    sizes: dict[ShardId, int] = {}
    saved_here: set[ShardId] = set()
    for rank, shards in zip(group_ranks(group), _gather_in_group(local, group)):
        for sid, nbytes, is_main in shards:
            holders.setdefault(sid, []).append(rank)
            sizes[sid] = nbytes
            if is_main:
                saved_here.add(sid)
    return distribute_shards({sid: holders[sid] for sid in saved_here}, sizes)


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict,
    distribution: ShardDistribution,
    include: Callable[[ShardedBase], bool] | None = None,
) -> None:
    """Make this rank's shards main replicas exactly where `distribution` assigns them to it (in place)."""
    my_rank = dist.get_rank()
    for sh in nested_values(sharded_state_dict):
        if include is not None and not include(sh):
            continue
        sid = shard_id(sh)
        if sid not in distribution and is_main_replica(sh.replica_id):
            raise CheckpointingException(
                f"Shard {sid} is not in the cached save distribution: the state dict structure changed "
                "between saves; do not cache the distribution (assume_constant_structure=False)"
            )
        sh.replica_id = 0 if distribution.get(sid) == my_rank else 1


class FullyParallelSaveStrategyWrapper(SaveShardedStrategy):
    """Spreads writing of replicated shards evenly over `parallelization_group` (default: world).

    Args:
        strategy: the strategy that writes (its backend and version are this wrapper's).
        parallelization_group: ranks that share the writing.
        do_cache_distribution: compute the distribution once and reuse it (constant structure).
        include: only shards for which this returns True are redistributed (default: all).
    """

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: dist.ProcessGroup | None = None,
        do_cache_distribution: bool = False,
        include: Callable[[ShardedBase], bool] | None = None,
    ) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.include = include
        self.cached_distribution: ShardDistribution | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.apply_saving_parallelization(sharded_state_dict)
        self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Set `replica_id` so that each shard is a main replica on exactly the rank that writes it."""
        if not dist.is_initialized():
            return
        distribution = self.cached_distribution
        if distribution is None:
            distribution = determine_main_replica_uniform_distribution(
                sharded_state_dict, self.parallelization_group, self.include
            )
            if self.do_cache_distribution:
                self.cached_distribution = distribution
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, distribution, self.include)


EXCHANGE_ALGORITHMS = ("broadcast", "gather_object", "gather_rounds")


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Reads each tensor shard needed by several ranks of `parallelization_group` once, then broadcasts it.

    Args:
        strategy: the strategy that reads.
        parallelization_group: ranks that share the reading (default: world).
        do_cache_distribution: compute who reads what once and reuse it (constant structure).
        exchange_algo: Megatron-Core's choice of how the read shards are exchanged ('broadcast', 'gather_object',
            'gather_rounds'); accepted for compatibility, the shards are always broadcast from their reader.
    """

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: dist.ProcessGroup | None = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        if exchange_algo not in EXCHANGE_ALGORITHMS:
            raise ValueError(
                f"FullyParallelLoadStrategyWrapper(exchange_algo={exchange_algo!r}): use one of {EXCHANGE_ALGORITHMS}"
            )
        self.base_strategy = strategy
        self.exchange_algo = exchange_algo
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: ShardDistribution | None = None
        self._scratch: dict[ShardId, Callable[[], torch.Tensor]] = {}

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        if not dist.is_initialized() or dist.get_world_size(self.parallelization_group) == 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        distribution = self.cached_distribution
        if distribution is None:
            distribution = self.determine_loading_distribution(sharded_state_dict)
            if self.do_cache_distribution:
                self.cached_distribution = distribution
        my_rank = dist.get_rank()
        leaves = list(nested_values(sharded_state_dict))
        deferred = [
            sh for sh in leaves if isinstance(sh, ShardedTensor) and distribution.get(shard_id(sh), my_rank) != my_rank
        ]
        deferred_ids = {id(sh) for sh in deferred}
        own = {i: sh for i, sh in enumerate(leaves) if id(sh) not in deferred_ids}
        error, loaded = None, {}
        try:
            loaded = self.base_strategy.load(own, checkpoint_dir)
        except Exception as e:  # raised on every rank below: the others must not wait for its shards
            error = e
        raise_on_every_rank(error, f"Loading {checkpoint_dir}", self.parallelization_group)
        values = {id(own[i]): value for i, value in loaded.items()}

        exchanged: dict[ShardId, torch.Tensor] = {}
        for sh in own.values():
            if isinstance(sh, ShardedTensor) and shard_id(sh) in distribution:
                exchanged[shard_id(sh)] = values[id(sh)]
        for sh in deferred:
            exchanged.setdefault(shard_id(sh), _destination(sh))
        for sid in distribution:
            if sid not in exchanged:  # held by others only: receive into a scratch buffer
                exchanged[sid] = self._scratch[sid]()
        broadcast_shards(exchanged, distribution, self.parallelization_group)
        for sh in deferred:
            values[id(sh)] = exchanged[shard_id(sh)]
        return dict_list_map_outplace(lambda sh: values[id(sh)], sharded_state_dict)

    def determine_loading_distribution(self, sharded_state_dict: ShardedStateDict) -> ShardDistribution:
        """Collective: for each tensor shard needed by 2+ ranks, the rank that reads it from storage."""
        local = [
            (shard_id(sh), shard_nbytes(sh), sh.dtype, _data_shape(sh))
            for sh in nested_values(sharded_state_dict)
            if isinstance(sh, ShardedTensor)
        ]
        holders: dict[ShardId, list[int]] = {}
        sizes: dict[ShardId, int] = {}
        self._scratch = {}
        for rank, shards in zip(
            group_ranks(self.parallelization_group), _gather_in_group(local, self.parallelization_group)
        ):
            for sid, nbytes, dtype, shape in shards:
                holders.setdefault(sid, []).append(rank)
                sizes[sid] = nbytes
                self._scratch[sid] = lambda shape=shape, dtype=dtype: torch.empty(shape, dtype=dtype)
        return distribute_shards({sid: ranks for sid, ranks in holders.items() if len(set(ranks)) > 1}, sizes)


def _data_shape(sh_ten: ShardedTensor) -> tuple[int, ...]:
    if sh_ten.flattened_range is not None:
        return (sh_ten.flattened_range.stop - sh_ten.flattened_range.start,)
    return sh_ten.local_shape


def _destination(sh_ten: ShardedTensor) -> torch.Tensor:
    """Where a shard another rank reads arrives: the template's tensor, or a new CPU tensor."""
    if sh_ten.data is not None:
        return sh_ten.data.detach()
    return torch.empty(_data_shape(sh_ten), dtype=sh_ten.dtype)

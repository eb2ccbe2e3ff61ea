"""Splitting shards between ranks and exchanging them over a process group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable

import torch
import torch.distributed as dist

from .mapping import ShardedBase, ShardedTensor

ShardId = tuple


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors must live for collectives on `group`: CPU for gloo, else the current accelerator."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of `group` (default: the world), in group-rank order."""
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def shard_id(sh_base: ShardedBase) -> ShardId:
    """What identifies the same piece of data on every rank that holds a copy of it."""
    if isinstance(sh_base, ShardedTensor):
        rng = sh_base.flattened_range
        return (sh_base.key, sh_base.global_offset, None if rng is None else (rng.start, rng.stop))
    return (sh_base.unique_key,)


def shard_nbytes(sh_base: ShardedBase) -> int:
    """Bytes a shard takes (objects count as one byte: they are small and go by count)."""
    if isinstance(sh_base, ShardedTensor):
        numel = 1
        for size in sh_base.local_shape:
            numel *= size
        if sh_base.flattened_range is not None:
            numel = sh_base.flattened_range.stop - sh_base.flattened_range.start
        return numel * sh_base.dtype.itemsize
    return 1


def distribute_shards(holders: dict[Hashable, list[int]], sizes: dict[Hashable, int]) -> dict[Hashable, int]:
    """Give each shard to one of the ranks that hold it, largest shards first to the least loaded rank,
    so bytes are spread as evenly as the holders allow. Deterministic: every rank computes the same."""
    load: dict[int, int] = defaultdict(int)
    assignment = {}
    for sid in sorted(holders, key=lambda s: (-sizes[s], repr(s))):
        rank = min(holders[sid], key=lambda r: (load[r], r))
        assignment[sid] = rank
        load[rank] += sizes[sid]
    return assignment


def broadcast_shards(
    tensors: dict[ShardId, torch.Tensor], owners: dict[ShardId, int], group: dist.ProcessGroup | None = None
) -> None:
    """Fill `tensors[sid]` on every rank from its owner's copy, for every exchanged `sid`.

    `tensors` holds the destination (or, on the owner, the loaded data) for each shard id in
    `owners`, on every rank of `group`; ids are processed in one agreed order. Tensors not on the
    collective device (e.g. CPU tensors with NCCL) go through a temporary copy.
    """
    device = collective_device(group)
    my_rank = dist.get_rank()
    for sid in sorted(owners, key=repr):
        tensor = tensors[sid]
        staged = tensor if tensor.device == device and tensor.is_contiguous() else tensor.to(device).contiguous()
        dist.broadcast(staged, src=owners[sid], group=group)
        if staged is not tensor and owners[sid] != my_rank:
            tensor.copy_(staged)

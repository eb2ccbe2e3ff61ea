"""DTensors as `ShardedTensor`s: any mesh and placements (TP, FSDP, both) to `dist_checkpointing` and back.

Each rank's local shard of a DTensor is one box of the global tensor (`Shard` on any dims, FSDP's `Shard(0)`
over `dp` on top of TP's `Shard(0)` over `tp`, which torch records as a strided shard). Its offset is the one
torch computes for the placements; `Replicate` mesh dimensions become the `replica_id`, so only
coordinate 0 of each replicated dimension writes. Checkpoints keep global shapes only, so a checkpoint saved
on one layout loads on any other. `nemo_ckpt.strategy.state_dict` builds whole model and optimizer state dicts
with it.
"""

import torch
from torch.distributed.tensor import DTensor, Replicate

from .._compat import dtensor_local_shape_and_offset, is_strided_shard
from .mapping import ShardedTensor
from .utils import get_world_size


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: the local shard of a DTensor, else the tensor; sharing its storage."""
    return tensor.to_local().detach() if isinstance(tensor, DTensor) else tensor.detach()


def dtensor_to_sharded_tensor(key: str, tensor: DTensor, outer_replica_id: int | None = None) -> ShardedTensor:
    """This rank's shard of `tensor` as a `ShardedTensor` whose `data` shares the DTensor's local storage.

    Args:
        key: checkpoint key of the global tensor.
        tensor: a DTensor without `Partial` placements.
        outer_replica_id: for a DTensor on a mesh that does not span all ranks (a `tp`-mesh DTensor replicated by
            plain data parallelism), this rank's copy of that mesh, e.g. its dp rank; 0 marks the copy that is
            saved. Ignored when the mesh spans all ranks (there is one copy).
    """
    mesh, placements = tensor.device_mesh, tensor.placements
    if any(placement.is_partial() for placement in placements):
        raise ValueError(
            f"{key}: cannot checkpoint a DTensor with Partial placements {placements}; "
            "redistribute it to Shard/Replicate first"
        )
    if mesh.size() == get_world_size():
        outer_replica_id = 0
    elif outer_replica_id is None:
        raise ValueError(
            f"{key}: the DTensor's mesh has {mesh.size()} of {get_world_size()} ranks; pass "
            "outer_replica_id (this rank's copy of the mesh, e.g. its data-parallel rank)"
        )
    local = tensor.to_local().detach()
    local_shape, global_offset = dtensor_local_shape_and_offset(tensor)
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(
            f"{key}: local shard shape {tuple(local.shape)} is not the shape {tuple(local_shape)} "
            f"torch computes for placements {placements}"
        )
    shard_counts = [1] * tensor.ndim
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard() or is_strided_shard(placement):
            shard_counts[placement.dim] *= mesh.size(mesh_dim)
    is_regular = all(size % count == 0 for size, count in zip(tensor.shape, shard_counts))
    replicate_coordinates = tuple(
        mesh.get_local_rank(mesh_dim)
        for mesh_dim, placement in enumerate(placements)
        if isinstance(placement, Replicate)
    )
    return ShardedTensor(
        key=key,
        data=local,
        dtype=local.dtype,
        local_shape=tuple(local_shape),
        global_shape=tuple(tensor.shape),
        global_offset=tuple(global_offset),
        axis_fragmentations=tuple(shard_counts) if is_regular else None,
        replica_id=(outer_replica_id, *replicate_coordinates),
    )

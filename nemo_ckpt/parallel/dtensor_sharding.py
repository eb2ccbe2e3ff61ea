"""DTensors as `ShardedTensor`s: any mesh and placements (TP, FSDP, both) to `dist_checkpointing` and back.

Each rank's local shard of a DTensor is one box of the global tensor (`Shard` on any dims, FSDP's `Shard(0)`
over `dp` on top of TP's `Shard(0)` over `tp`, which torch records as `_StridedShard`). Its offset comes from
torch's `compute_local_shape_and_global_offset`; `Replicate` mesh dimensions become the `replica_id`, so only
coordinate 0 of each replicated dimension writes. Checkpoints keep global shapes only, so a checkpoint saved
on one layout loads on any other. `nemo_ckpt.sharding` builds whole model and optimizer state dicts with it.
"""

import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from nemo_ckpt.dist_checkpointing import ShardedTensor


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


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
        raise ValueError(f"{key}: cannot checkpoint a DTensor with Partial placements {placements}; "
                         "redistribute it to Shard/Replicate first")
    if mesh.size() == _world_size():
        outer_replica_id = 0
    elif outer_replica_id is None:
        raise ValueError(f"{key}: the DTensor's mesh has {mesh.size()} of {_world_size()} ranks; pass "
                         "outer_replica_id (this rank's copy of the mesh, e.g. its data-parallel rank)")
    local = tensor.to_local().detach()
    local_shape, global_offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(f"{key}: local shard shape {tuple(local.shape)} is not the shape {tuple(local_shape)} "
                         f"torch computes for placements {placements}")
    shard_counts = [1] * tensor.ndim
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard() or isinstance(placement, _StridedShard):
            shard_counts[placement.dim] *= mesh.size(mesh_dim)
    is_regular = all(size % count == 0 for size, count in zip(tensor.shape, shard_counts))
    replicate_coordinates = tuple(mesh.get_local_rank(mesh_dim) for mesh_dim, placement in enumerate(placements)
                                  if isinstance(placement, Replicate))
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

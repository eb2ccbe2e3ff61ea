"""DTensors as `ShardedTensor`s: any mesh and placements (TP, FSDP, both) to `dist_checkpointing` and back.

Each rank's local shard of a DTensor is one box of the global tensor (`Shard` on any dims, FSDP's `Shard(0)`
over `dp` on top of TP's `Shard(0)` over `tp`, which torch records as `_StridedShard`). Its offset comes from
torch's `compute_local_shape_and_global_offset`; `Replicate` mesh dimensions become the `replica_id`, so only
coordinate 0 of each replicated dimension writes. Checkpoints keep global shapes only, so a checkpoint saved
on one layout loads on any other.
"""

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from nemo_ckpt.dist_checkpointing import ShardedTensor


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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


def to_sharded_tensor(key: str, tensor: torch.Tensor, outer_replica_id: int | None = None) -> ShardedTensor:
    """A DTensor as its shard (see `dtensor_to_sharded_tensor`); a plain tensor as a whole replica on every rank."""
    if isinstance(tensor, DTensor):
        return dtensor_to_sharded_tensor(key, tensor, outer_replica_id)
    return ShardedTensor.from_rank_offsets(key, tensor, replica_id=_rank())


def sharded_state_dict(state_dict: Mapping[str, Any], prefix: str = "",
                       outer_replica_id: int | None = None) -> dict[str, Any]:
    """A module's `state_dict()` keyed `prefix + name`, every tensor as a `ShardedTensor` of that key."""
    return {prefix + name: to_sharded_tensor(prefix + name, value, outer_replica_id)
            if isinstance(value, torch.Tensor) else value for name, value in state_dict.items()}


def optimizer_sharded_state_dict(optim_state: Mapping[str, Any], prefix: str = "",
                                 outer_replica_id: int | None = None) -> dict[str, Any]:
    """Per-parameter optimizer state as `ShardedTensor`s keyed `optimizer.state.<name>.<prefix><param>`.

    `optim_state` is keyed by parameter name (`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`).
    Tensors shard like their DTensor; scalar plain tensors (Adam's `step`) stay in the common state.
    """
    state = {}
    for param_name, param_state in optim_state["state"].items():
        state[param_name] = {
            name: to_sharded_tensor(f"optimizer.state.{name}.{prefix}{param_name}", value, outer_replica_id)
            if isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.ndim > 0) else value
            for name, value in param_state.items()
        }
    return {"state": state, "param_groups": optim_state["param_groups"]}


def restore_dtensors(loaded: Any, template: Any) -> Any:
    """`loaded` (plain local shards from `dist_checkpointing.load`) as DTensors wherever `template` has one."""
    if isinstance(template, DTensor):
        if isinstance(loaded, DTensor):
            return loaded
        return DTensor.from_local(loaded, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())
    if isinstance(template, Mapping) and isinstance(loaded, Mapping):
        return {key: restore_dtensors(value, template[key]) if key in template else value
                for key, value in loaded.items()}
    if isinstance(template, (list, tuple)) and isinstance(loaded, (list, tuple)) and len(template) == len(loaded):
        return type(loaded)(restore_dtensors(value, entry) for value, entry in zip(loaded, template))
    return loaded

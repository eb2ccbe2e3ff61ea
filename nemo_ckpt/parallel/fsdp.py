"""FSDP2 (`fully_shard`) for the `optim_grads` and `optim_grads_params` sharding strategies."""

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from nemo_ckpt.parallel.checkpoint_rule import CheckpointRule
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.meta_init import materialize


def declared_units(root: nn.Module) -> tuple[type[nn.Module], ...]:
    """The unit classes the modules under `root` declare in their `fsdp_unit_modules` class attribute."""
    declared: list[type[nn.Module]] = []
    for module in root.modules():
        declared += [cls for cls in getattr(module, "fsdp_unit_modules", ()) if cls not in declared]
    return tuple(declared)


def outermost_units(root: nn.Module, unit_classes: tuple[type[nn.Module], ...]) -> list[nn.Module]:
    """The modules of `unit_classes` under `root` that are not inside another such module, in module order."""
    units: list[nn.Module] = []
    for module in root.modules():
        if module is not root and isinstance(module, unit_classes):
            if not any(module in set(unit.modules()) for unit in units):
                units.append(module)
    return units


def apply_fsdp(
    roots: list[nn.Module],
    mesh: DeviceMesh,
    config: DistributedDataParallelConfig,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
) -> list[FSDPModule]:
    """Shard each of `roots` in place: its unit modules one by one, then the root itself.

    A module still on `meta` is materialized (`to_empty` + `reset_parameters`) just before it is sharded, so at
    most one full unit exists at a time. `param_dtype` (bf16 mixed precision) is the all-gather and compute
    dtype; the sharded fp32 parameters are the optimizer's master weights; gradients are reduced in fp32 when
    `config.grad_reduce_in_fp32`. Returns the FSDP modules in forward order.
    """
    reduce_dtype = torch.float32 if config.grad_reduce_in_fp32 else param_dtype
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard_after_forward = config.data_parallel_sharding_strategy == "optim_grads_params"
    fsdp_modules: list[FSDPModule] = []
    for root in roots:
        units = outermost_units(root, config.fsdp_unit_module_classes() or declared_units(root))
        for unit in units:
            materialize(unit, device)
            fsdp_modules.append(
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
            )
        materialize(root, device)
        # the root's parameters are used again right at the start of backward: keep them gathered
        fsdp_modules.append(fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy))
    if not config.average_in_collective and mesh.device_type == "cuda":
        # NCCL would average in the collective; gloo has no AVG, so FSDP2 divides and sums there anyway
        for module in fsdp_modules:
            module.set_force_sum_reduction_for_comms(True)
    if config.overlap_param_gather:
        units = [module for module in fsdp_modules if module not in roots]
        for previous, following in zip(units, units[1:]):
            previous.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([previous])
    return fsdp_modules


class ShardedStagesRule(CheckpointRule):
    """FSDP2 over pipeline stages: a stage's entries are shards of the dp x cp mesh and no other rank holds a copy
    (the other stages hold other keys), so every entry is replica 0 (without a pipeline, the shards' mesh spans
    all ranks and says so itself)."""

    def replica_ids(self, state_dict: dict[str, Any]) -> dict[str, int]:
        return dict.fromkeys(state_dict, 0)

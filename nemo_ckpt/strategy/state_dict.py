"""A module's and an optimizer's live state as `ShardedTensor`s for `dist_checkpointing`, and back.

Keys do not depend on the layout, so any layout resumes any other: a parameter keeps its module FQN (e.g.
`module.layers.0.mlp.up_proj.weight`), its optimizer state is `optimizer.state.<exp_avg|...>.<fqn>`, and state
that is not parameter-shaped (Adam's scalar `step`) stays in the common (rank-0) part. A replicated tensor is
written by the rank with `replica_id == 0`; a DTensor (FSDP2) is described by its local shard and global
offset, each shard written by its owner. The ShardedTensors' data are the live tensors, so a load writes
straight into the parameters and optimizer state.
"""

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.dist_checkpointing.dtensor import dtensor_to_sharded_tensor, local_tensor
from nemo_ckpt.parallel.checkpoint_rule import CheckpointRule


def dtensor_sharded_tensor(key: str, dtensor: DTensor, replica_id: int) -> ShardedTensor | None:
    """This rank's shard of `dtensor` (any placements, see `dtensor_to_sharded_tensor`); None if it is empty.

    `replica_id` tells copies of a DTensor whose mesh does not span all ranks apart (a tensor-parallel DTensor
    under DDP: the data-parallel rank). Of replicated shards, the copy at replica 0 and at coordinate 0 of every
    `Replicate` mesh dimension writes.
    """
    if local_tensor(dtensor).numel() == 0:
        return None
    return dtensor_to_sharded_tensor(key, dtensor, outer_replica_id=replica_id)


def model_sharded_state_dict(
    state_dict: dict[str, Any], replica_id: int, replica_ids: dict[str, int] | None = None
) -> dict[str, Any]:
    """Each tensor of a module's `state_dict()` as a ShardedTensor under its own key.

    Plain tensors are replicated (`replica_id`: this rank's index among the replicas); DTensors are sharded.
    `replica_ids` overrides `replica_id` for some keys (experts split over ranks: their expert-data-parallel
    rank). Keys whose local shard is empty are left out.
    """
    sharded = {}
    for key, value in state_dict.items():
        key_replica_id = (replica_ids or {}).get(key, replica_id)
        if isinstance(value, DTensor):
            value = dtensor_sharded_tensor(key, value, key_replica_id)
            if value is None:
                continue
        elif isinstance(value, torch.Tensor):
            value = ShardedTensor.from_rank_offsets(key, value.detach(), replica_id=key_replica_id)
        sharded[key] = value
    return sharded


def sharded_model_state(module: nn.Module, rules: list[CheckpointRule], replica_id: int) -> dict[str, Any]:
    """`module`'s state as ShardedTensors: replicated over dp x cp (`replica_id`: this rank's dp x cp rank) unless
    a parallelism's rule says otherwise (later rules override earlier ones)."""
    state_dict = module.state_dict()
    replica_ids: dict[str, int] = {}
    for rule in rules:
        replica_ids |= rule.replica_ids(state_dict)
    return model_sharded_state_dict(state_dict, replica_id=replica_id, replica_ids=replica_ids)


def sharded_optimizer_state(
    optimizer: Optimizer, module: nn.Module, rules: list[CheckpointRule], model_state: dict[str, Any]
) -> dict[str, Any]:
    """`optimizer`'s state as ShardedTensors beside `model_state` (`sharded_model_state`), completed and marked by
    the parallelisms' rules."""
    names = parameter_names(module)
    state = named_optimizer_state(optimizer, names)
    for rule in rules:
        state = rule.complete_optimizer_state(optimizer, state, names)
    replica_ids = [rule.optimizer_replica_id(optimizer) for rule in rules]
    state_replica_id = next((replica_id for replica_id in replica_ids if replica_id is not None), None)
    sharded = optimizer_sharded_state_dict(state, model_state, state_replica_id=state_replica_id)
    for rule in rules:
        rule.finish_optimizer_state(sharded)
    return sharded


def parameter_names(module: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter of `module` and its name (the key of its optimizer state in a checkpoint)."""
    return {param: name for name, param in module.named_parameters()}


def saves_gpu_buffers(module: nn.Module) -> bool:
    """Whether `module`'s state dict holds buffers on a GPU. Unlike parameters and optimizer state, which only the
    optimizer's update changes, a buffer may change in forward (BatchNorm's statistics, DDP's buffer broadcast)."""
    parameters = {id(param) for param in module.parameters()}
    return any(
        isinstance(value, torch.Tensor) and value.is_cuda and id(value) not in parameters
        for value in module.state_dict(keep_vars=True).values()
    )


def named_optimizer_state(optimizer: Optimizer, names: dict[nn.Parameter, str]) -> dict[str, Any]:
    """`optimizer.state_dict()` keyed by parameter name (`names`), with the live state tensors (no copies)."""
    return {
        "state": {names[param]: dict(state) for param, state in optimizer.state.items()},
        "param_groups": [
            {
                **{key: value for key, value in group.items() if key != "params"},
                "params": [names[param] for param in group["params"]],
            }
            for group in optimizer.param_groups
        ],
    }


def optimizer_sharded_state_dict(
    optim_state: dict[str, Any], model_sharded: dict[str, Any], state_replica_id: int | None = None
) -> dict[str, Any]:
    """Shard each parameter-shaped state tensor like its parameter, under `optimizer.state.<name>.<param key>`.

    `optim_state` is keyed by parameter name (`named_optimizer_state`). Tensors that are not parameter-shaped
    (Adam's scalar `step`) stay common. `state_replica_id` overrides the parameters' replica ids (ZeRO-1:
    0, each rank holds the only copy of its parameters' state).
    """
    state = {}
    for param_name, param_state in optim_state["state"].items():
        model_tensor = model_sharded.get(param_name)
        entries = {}
        for name, value in param_state.items():
            local = local_tensor(value) if isinstance(value, torch.Tensor) else None
            if local is not None and local.dim() > 0 and model_tensor is None:
                continue  # an empty FSDP2 shard: nothing to save or load here
            if local is not None and model_tensor is not None and local.shape == model_tensor.data.shape:
                replica_id = model_tensor.replica_id if state_replica_id is None else state_replica_id
                value = replace(
                    model_tensor,
                    key=f"optimizer.state.{name}.{model_tensor.key}",
                    data=local,
                    dtype=local.dtype,
                    replica_id=replica_id,
                )
            entries[name] = value
        state[param_name] = entries
    return {"state": state, "param_groups": optim_state["param_groups"]}


@torch.no_grad()
def init_optimizer_state(optimizer: Optimizer) -> None:
    """Create the optimizer's state (lazy in torch) with a step on zero gradients at learning rate 0.

    Leaves the parameters unchanged for Adam(W) and SGD, whose updates are proportional to the learning rate.
    """
    if optimizer.state:
        return
    params = [param for group in optimizer.param_groups for param in group["params"] if param.requires_grad]
    for param in params:
        param.grad = torch.zeros_like(param)
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, learning_rates):
        group["lr"] = lr
    for param in params:
        param.grad = None


@torch.no_grad()
def copy_into(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy `loaded` into `target`'s local part unless a load already wrote it there."""
    target = local_tensor(target)
    if target.data_ptr() != loaded.data_ptr() or target.shape != loaded.shape:
        target.copy_(loaded)


def load_module_state(module: nn.Module, loaded: dict[str, Any], strict: bool = True) -> None:
    """Copy the loaded local shards into `module`'s parameters and buffers.

    With `strict`, a key this rank holds a (non-empty) shard of must be in `loaded`; else it keeps its value.
    """
    missing = []
    for key, tensor in module.state_dict().items():
        if key in loaded:
            copy_into(tensor, loaded[key])
        elif local_tensor(tensor).numel() > 0:
            missing.append(key)
    if strict and missing:
        raise KeyError(
            f"The checkpoint has no weights for {missing}; load it with strict=False to keep their current values"
        )


# kept from the live optimizer on load: its parameters and how torch computes its step (e.g. a checkpoint saved by
# the unfused AdamW resumes fused); the other group entries (learning rate, betas, ...) come from the checkpoint
LIVE_GROUP_KEYS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})


def load_named_optimizer_state(optimizer: Optimizer, names: dict[nn.Parameter, str], loaded: dict[str, Any]) -> None:
    """Restore `optimizer` (its state already initialized) from a loaded `named_optimizer_state`."""
    if len(loaded["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(loaded['param_groups'])} parameter groups, this one "
            f"{len(optimizer.param_groups)}; configure the optimizer as when the checkpoint was saved"
        )
    for group, loaded_group in zip(optimizer.param_groups, loaded["param_groups"]):
        group.update({key: value for key, value in loaded_group.items() if key not in LIVE_GROUP_KEYS})
    for param, state in optimizer.state.items():
        for key, value in loaded["state"].get(names[param], {}).items():
            if isinstance(state.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                copy_into(state[key], value)
            else:
                state[key] = value

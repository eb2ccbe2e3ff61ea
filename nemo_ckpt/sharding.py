"""Describe a module's and an optimizer's state as `ShardedTensor`s for `dist_checkpointing`."""

from dataclasses import replace
from typing import Any

import torch

from nemo_ckpt.dist_checkpointing import ShardedTensor


def replicated_sharded_state_dict(state_dict: dict[str, Any], replica_id: int) -> dict[str, Any]:
    """Every tensor is held whole by each data-parallel rank; the rank with `replica_id == 0` writes it."""
    return {
        key: ShardedTensor.from_rank_offsets(key, value, replica_id=replica_id)
        if isinstance(value, torch.Tensor) else value
        for key, value in state_dict.items()
    }


def optimizer_sharded_state_dict(optim_state: dict[str, Any], model_sharded: dict[str, Any]) -> dict[str, Any]:
    """Shard each per-parameter state tensor like its parameter, under `optimizer.state.<name>.<param key>`.

    `optim_state` is keyed by parameter name (`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`);
    tensors that do not have their parameter's shape (Adam's scalar `step`) stay common.
    """
    state = {}
    for param_name, param_state in optim_state["state"].items():
        model_tensor = model_sharded[param_name]
        state[param_name] = {
            name: replace(model_tensor, key=f"optimizer.state.{name}.{model_tensor.key}", data=value, dtype=value.dtype)
            if isinstance(value, torch.Tensor) and value.shape == model_tensor.data.shape else value
            for name, value in param_state.items()
        }
    return {"state": state, "param_groups": optim_state["param_groups"]}

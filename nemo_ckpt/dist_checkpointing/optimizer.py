"""Optimizer state sharding derived from the model's ShardedTensors.

Build the model sharded state dict from `model.state_dict(keep_vars=True)` so that
ShardedTensor `data` are the very Parameters the optimizer holds; then
`get_param_id_to_sharded_param_map` and `optim_state_to_sharding_state`
turn `optimizer.state_dict()` into a sharded state dict.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import replace

import torch

from .dict_utils import nested_values
from .mapping import LocalNonpersistentObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict
from .utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

KEEP_VARS_HINT = (
    " Make sure state dict contains original torch.nn.Parameters (not pure torch.Tensors)"
    " by passing `keep_vars=True` to `.state_dict()`. If any transformation of the original"
    " parameter is needed, use a ShardedTensorFactory."
)


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> dict[int, int]:
    """`{id(param): optimizer state id}` in optimizer parameter order."""
    param_mappings: dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        param_mappings.setdefault(id(param), i)
    return param_mappings


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> dict[int, ShardedTensor | ShardedTensorFactory]:
    """Map optimizer state ids to the model ShardedTensors (or factories) wrapping those params.

    `optim_params_iter` must iterate the optimizer's params in its order, e.g.
    `itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)`.
    """
    model_sharded_state_dict, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    id_to_sharded_param: dict[int, ShardedTensor | ShardedTensorFactory] = {}
    for ten in nested_values(model_sharded_state_dict):
        if id(ten.data) in param_to_id:
            id_to_sharded_param[param_to_id[id(ten.data)]] = ten
        else:
            logger.debug("%s is not tracked by the optimizer", ten)
    if not id_to_sharded_param:
        logger.warning("Sharded parameters mapping is empty." + KEEP_VARS_HINT)
    return id_to_sharded_param


def make_sharded_optimizer_tensor(
    model_param: ShardedTensor | ShardedTensorFactory, optim_param: torch.Tensor, prefix: str
) -> ShardedTensor | ShardedTensorFactory:
    """An optimizer-state entity sharded exactly like `model_param`, keyed `<prefix>.<key>`.

    A 0-d state (Adam's `step`) of a non-scalar param becomes a scalar ShardedTensor
    whose main replica is the param's main replica of its first shard.
    """
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    if optim_param.ndim == 0 and model_param.local_shape != ():
        is_first_shard = not any(model_param.global_offset) and (
            model_param.flattened_range is None or model_param.flattened_range.start == 0
        )
        main = is_first_shard and _is_main(model_param.replica_id)
        return ShardedTensor.from_rank_offsets(key, optim_param, replica_id=0 if main else 1)
    expected = model_param.local_shape
    if model_param.flattened_range is not None:
        expected = (model_param.flattened_range.stop - model_param.flattened_range.start,)
    if tuple(optim_param.shape) != expected:
        raise ValueError(
            f"Optimizer state shape {tuple(optim_param.shape)} does not match model shape {expected} for {key}"
        )
    sh_ten = replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)
    sh_ten.validate_metadata_integrity()
    return sh_ten


def _is_main(replica_id: int | tuple[int, ...]) -> bool:
    return replica_id == 0 if isinstance(replica_id, int) else all(r == 0 for r in replica_id)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: dict[int, ShardedTensor | ShardedTensorFactory],
    exclude_keys: tuple[str, ...] = (),
) -> None:
    """Turn `optimizer.state_dict()` into a sharded state dict, in place.

    Every tensor in `state[param_id]` becomes a ShardedTensor keyed
    `optimizer.state.<state_key>.<model key>`; `param_groups[*]['params']` become
    LocalNonpersistentObjects (the ids are local to this process).
    """
    sharded_state: dict[int, dict] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if param_id not in id_to_sharded_param_map:
            raise ValueError(f"Param id {param_id} does not match any model sharded param." + KEEP_VARS_HINT)
        sharded_state[param_id] = {}
        for state_key, value in param_state.items():
            if state_key in exclude_keys:
                continue
            if isinstance(value, torch.Tensor):
                value = make_sharded_optimizer_tensor(
                    id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{state_key}"
                )
            sharded_state[param_id][state_key] = value
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state

"""ZeRO-1 (the `optim` sharding strategy): each parameter's optimizer state lives on one data-parallel rank.

Gradients are all-reduced by DDP as usual, so gradient clipping sees every gradient. The optimizer's parameter
groups keep only this rank's parameters, so it updates, and keeps state for, only those; after the step each
owner broadcasts its updated parameters and the other ranks drop those gradients. With `overlap_param_gather`
the broadcasts run in the background and each module waits for its own parameters when its next forward
starts.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from nemo_ckpt.parallel.checkpoint_rule import CheckpointRule


def assign_owners(numels: list[int], world_size: int) -> list[int]:
    """The owning rank of each parameter: largest first, each to the least-loaded rank (ties: lowest rank)."""
    loads = [0] * world_size
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += numels[index]
    return owners


class ZeroOneSharding(CheckpointRule):
    """Partitions `optimizer` over the ranks of `group` by parameter (hooks on the optimizer and on `module`).

    In a checkpoint, this rank's optimizer state is the only copy (replica 0), and the common part lists every
    rank's parameters and scalar state.
    """

    def __init__(
        self, optimizer: Optimizer, module: nn.Module, group: dist.ProcessGroup, overlap_param_gather: bool
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.overlap_param_gather = overlap_param_gather
        self.params = [
            param for param_group in optimizer.param_groups for param in param_group["params"] if param.requires_grad
        ]
        owners = assign_owners([param.numel() for param in self.params], group.size())
        if len(set(owners)) < group.size():
            raise ValueError(
                f"ZeRO-1 ('optim') needs at least one parameter per data-parallel rank: "
                f"{len(self.params)} parameters for {group.size()} ranks; use fewer ranks or 'no_shard'"
            )
        self.owner = dict(zip(self.params, owners))
        self.group_params = [list(param_group["params"]) for param_group in optimizer.param_groups]
        for param_group in optimizer.param_groups:
            param_group["params"] = [
                param for param in param_group["params"] if param in self.owner and self.owns(param)
            ]
        self.optimizer = optimizer
        self._pending: dict[nn.Parameter, dist.Work] = {}
        optimizer.register_step_post_hook(self._broadcast_params)
        if overlap_param_gather:
            mine = set(self.params)
            for submodule in module.modules():
                own = [param for param in submodule.parameters(recurse=False) if param in mine]
                if own:
                    submodule.register_forward_pre_hook(lambda *_, params=own: self.wait_for_params(params))

    def owns(self, param: nn.Parameter) -> bool:
        return self.owner[param] == self.rank

    def _broadcast_params(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.wait_for_params()
        for param in self.params:
            if not self.owns(param):
                param.grad = None
            self._pending[param] = dist.broadcast(
                param.detach(), group=self.group, group_src=self.owner[param], async_op=True
            )
        if not self.overlap_param_gather:
            self.wait_for_params()

    def wait_for_params(self, params: list[nn.Parameter] | None = None) -> None:
        """Wait until `params` (default: all) hold their owners' updated values."""
        for param in self.params if params is None else params:
            work = self._pending.pop(param, None)
            if work is not None:
                work.wait()

    def optimizer_replica_id(self, optimizer: Optimizer) -> int | None:
        return 0 if optimizer is self.optimizer else None

    def complete_optimizer_state(
        self, optimizer: Optimizer, named_state: dict[str, Any], names: dict[nn.Parameter, str]
    ) -> dict[str, Any]:
        """Make this rank's `named_optimizer_state` describe the whole optimizer, as the common part of a
        checkpoint must: all parameters in the groups, and the other ranks' non-tensor-shaped state (Adam's
        `step`) for theirs. Their tensor state stays with them."""
        if optimizer is not self.optimizer:
            return named_state
        for param_group, params in zip(named_state["param_groups"], self.group_params):
            param_group["params"] = [names[param] for param in params]
        state = named_state["state"]
        common = {
            name: {
                key: value
                for key, value in param_state.items()
                if not (isinstance(value, torch.Tensor) and value.dim() > 0)
            }
            for name, param_state in state.items()
        }
        gathered: list[dict] = [{} for _ in range(self.group.size())]
        dist.all_gather_object(gathered, common, group=self.group)
        for param in self.params:
            name = names[param]
            if name not in state:
                state[name] = gathered[self.owner[param]].get(name, {})
        return named_state

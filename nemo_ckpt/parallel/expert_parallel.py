"""Expert parallelism: experts split over the `ep` ranks of the expert mesh, tokens sent to them by all-to-all.

The expert mesh is (pp, edp, ep, tp) (`ParallelDims.build_expert_mesh`): an ep group is `ep` adjacent ranks of
dp x cp, each holding `num_experts / ep` experts; the `edp` ranks hold the same experts and average their
gradients. A model takes part through modules with the `ExpertParallelLayer` interface (e.g. the GPT's
`MoELayer`): this module tells them which experts are theirs and the process groups; their forward calls
`dispatch` / `combine`. Parameters under a module named `experts` (`EXPERTS_MODULE_NAME`) are expert parameters.

Gradients: an expert's gradient sums the contributions of the tokens of all ranks of its ep group (all-to-all's
backward brings them back), so it is averaged over edp and divided by ep, i.e. summed over edp and divided by the
dp x cp size; dense parameters are averaged over dp x cp as usual (`ExpertParallelGradReducer` without FSDP2;
with FSDP2 through the gradient divide factor of the experts' FSDP units on the edp mesh).

Tensor parallelism (`expert_tensor_parallel_size`, Megatron-Core's option): the tp ranks of a dp rank route the
same tokens, so an ep group is made of ranks with the same tp rank and tp is the expert mesh's last dimension.
Each expert is sharded over tp like the dense MLP (expert_tensor_parallel_size = tensor_model_parallel_size,
Megatron's default) or held whole by every tp rank (1; Megatron instead spreads experts over tp x dp ranks then).
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.dist_checkpointing.dtensor import local_tensor
from nemo_ckpt.parallel.checkpoint_rule import CheckpointRule
from nemo_ckpt.parallel.mesh import EXPERT_DATA_PARALLEL_DIM, EXPERT_PARALLEL_DIM, TENSOR_PARALLEL_DIM, ParallelDims
from nemo_ckpt.parallel.meta_init import materialize

EXPERTS_MODULE_NAME = "experts"
"""The name of the module holding a layer's experts, keyed by global expert id (`...experts.{id}.*`)."""


@runtime_checkable
class ExpertParallelLayer(Protocol):
    """A mixture-of-experts layer that expert parallelism can split."""

    num_experts: int
    experts: nn.Module
    expert_tensor_parallel: bool
    """With tensor parallelism: shard each expert over tp (True) or hold it whole on every tp rank (False)."""

    def set_process_groups(
        self, data_parallel_group: dist.ProcessGroup | None, expert_parallel_group: dist.ProcessGroup | None
    ) -> None:
        """`data_parallel_group`: ranks reading different tokens (aux-loss statistics); `expert_parallel_group`:
        the ranks the experts are split over (None: all experts are local)."""

    def keep_experts(self, expert_ids: range) -> None:
        """Drop every expert but `expert_ids` (global ids)."""


def is_expert_key(key: str) -> bool:
    """Whether a parameter name or state-dict key belongs to an expert (`...experts.{id}...`)."""
    return f".{EXPERTS_MODULE_NAME}." in f".{key}"


def expert_layers(model: nn.Module) -> list[ExpertParallelLayer]:
    return [module for module in model.modules() if isinstance(module, ExpertParallelLayer)]


def local_expert_ids(num_experts: int, ep_rank: int, ep_size: int) -> range:
    """The global ids of the experts of ep rank `ep_rank`: a contiguous block, as in Megatron-Core."""
    if num_experts % ep_size:
        raise ValueError(
            f"expert_model_parallel_size={ep_size} must divide num_moe_experts={num_experts}; choose a divisor of it"
        )
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def apply_expert_parallel(
    model: nn.Module,
    expert_mesh: DeviceMesh | None,
    data_parallel_group: dist.ProcessGroup | None,
    expert_tensor_parallel: bool = True,
) -> list[ExpertParallelLayer]:
    """Keep each MoE layer's own experts (ep rank of `expert_mesh`; None: all) and give it its process groups;
    `expert_tensor_parallel`: whether tensor parallelism (applied after) is to shard the experts."""
    layers = expert_layers(model)
    for layer in layers:
        layer.expert_tensor_parallel = expert_tensor_parallel
        if expert_mesh is None:
            layer.set_process_groups(data_parallel_group, None)
            continue
        ep_mesh = expert_mesh[EXPERT_PARALLEL_DIM]
        layer.keep_experts(local_expert_ids(layer.num_experts, ep_mesh.get_local_rank(), ep_mesh.size()))
        layer.set_process_groups(data_parallel_group, ep_mesh.get_group())
    return layers


def move_to_expert_mesh(experts: nn.Module, expert_mesh: DeviceMesh) -> None:
    """Re-place tensor-parallel expert parameters (DTensors on the dense mesh's tp) on `expert_mesh`'s tp, the
    same ranks in the same order, in place: FSDP2 wants the tp and edp meshes to come from one mesh."""
    tp_mesh = expert_mesh[TENSOR_PARALLEL_DIM]
    for module in experts.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                placed = DTensor.from_local(
                    param.to_local().detach(),
                    tp_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


def shard_experts_fsdp(
    layers: list[ExpertParallelLayer],
    expert_mesh: DeviceMesh,
    data_parallel_size: int,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
) -> list[FSDPModule]:
    """FSDP2 of each layer's experts over the edp ranks (which hold the same experts), before the dense units.

    Gradients are divided by the dp x cp size (`data_parallel_size`), not by edp: see the module docstring.
    """
    units = []
    for layer in layers:
        materialize(layer.experts, device)
        move_to_expert_mesh(layer.experts, expert_mesh)
        unit = fully_shard(
            layer.experts,
            mesh=expert_mesh[EXPERT_DATA_PARALLEL_DIM],
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
        )
        # sum, then divide (gloo has no PREMUL_SUM); on one edp rank no collective runs, and FSDP2 would divide
        # twice with forced sums (torch 2.13)
        unit.set_force_sum_reduction_for_comms(expert_mesh[EXPERT_DATA_PARALLEL_DIM].size() > 1)
        unit.set_gradient_divide_factor(float(data_parallel_size))
        units.append(unit)
    return units


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx, tokens: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        output = tokens.new_empty(sum(output_splits), *tokens.shape[1:])
        dist.all_to_all_single(output, tokens.contiguous(), output_splits, input_splits, group=group)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return all_to_all(grad, output_splits, input_splits, ctx.group), None, None, None


def all_to_all(
    tokens: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable all-to-all of rows: `input_splits[r]` rows go to rank r, `output_splits[r]` come from it."""
    return _AllToAll.apply(tokens, output_splits, input_splits, group)


@dataclass(frozen=True)
class Dispatched:
    """What `combine` needs to send tokens back: the counts received [ep, local experts] and the split sizes."""

    received_counts: torch.Tensor
    sent_splits: list[int]
    received_splits: list[int]


def dispatch(
    tokens: torch.Tensor, tokens_per_expert: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, Dispatched]:
    """Send each rank of the ep `group` the tokens of its experts (all-to-all with variable splits).

    `tokens` [n, hidden] are sorted by global expert id, `tokens_per_expert` [num_experts] counts them. Returns
    the received tokens sorted by local expert (then by source rank), whose counts per local expert are
    `Dispatched.received_counts.sum(0)`.
    """
    ep_size = group.size()
    received_counts = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(received_counts, tokens_per_expert, group=group)  # counts of my experts from each rank
    received_counts = received_counts.view(ep_size, -1)
    sent_splits = tokens_per_expert.view(ep_size, -1).sum(dim=1).tolist()
    received_splits = received_counts.sum(dim=1).tolist()
    received = all_to_all(tokens, received_splits, sent_splits, group)
    chunks = received.split(received_counts.flatten().tolist())  # [source rank][local expert]
    local_experts = received_counts.shape[1]
    by_expert = [chunks[rank * local_experts + expert] for expert in range(local_experts) for rank in range(ep_size)]
    return torch.cat(by_expert), Dispatched(received_counts, sent_splits, received_splits)


def combine(expert_output: torch.Tensor, dispatched: Dispatched, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `dispatch`: send each processed token back to its rank, in the order it was sent."""
    ep_size, local_experts = dispatched.received_counts.shape
    chunks = expert_output.split(dispatched.received_counts.t().flatten().tolist())  # [local expert][source rank]
    by_rank = [chunks[expert * ep_size + rank] for rank in range(ep_size) for expert in range(local_experts)]
    return all_to_all(torch.cat(by_rank), dispatched.sent_splits, dispatched.received_splits, group)


class ExpertParallelGradReducer:
    """Gradient averaging without DDP when experts are split: dense gradients averaged over dp x cp
    (`data_parallel_group`), expert gradients summed over edp (`expert_data_parallel_group`) and divided by the
    dp x cp size. Call `finish()` after every backward (coalesced all-reduces, one per group)."""

    def __init__(
        self,
        module: nn.Module,
        data_parallel_group: dist.ProcessGroup,
        expert_data_parallel_group: dist.ProcessGroup,
    ) -> None:
        self.module = module
        self.data_parallel_group = data_parallel_group
        self.expert_data_parallel_group = expert_data_parallel_group

    @torch.no_grad()
    def finish(self) -> None:
        dense, experts = [], []
        for name, param in self.module.named_parameters():
            if param.grad is not None:
                (experts if is_expert_key(name) else dense).append(local_tensor(param.grad))
        divisor = self.data_parallel_group.size()
        for grads, group in ((dense, self.data_parallel_group), (experts, self.expert_data_parallel_group)):
            if not grads:
                continue
            flat = torch.cat([grad.flatten() for grad in grads])
            if group.size() > 1:
                dist.all_reduce(flat, group=group)
            flat.div_(divisor)
            for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
                grad.copy_(reduced.view_as(grad))


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).float()


def clip_grad_norm_expert_parallel(
    named_parameters: Iterable[tuple[str, nn.Parameter]], max_norm: float, expert_parallel_group: dist.ProcessGroup
) -> torch.Tensor:
    """Clip to a global L2 norm of `max_norm` when each ep rank holds different experts: the experts' squared
    norms are summed over the ep group, added to the dense one. Returns the norm before clipping (every rank)."""
    dense, experts = [], []
    for name, param in named_parameters:
        if param.grad is not None:
            (experts if is_expert_key(name) else dense).append(param)
    expert_norm = _total_norm([param.grad for param in experts])
    dense_norm = _total_norm([param.grad for param in dense])
    expert_square = expert_norm.square().to(dense_norm.device)
    dist.all_reduce(expert_square, group=expert_parallel_group)
    total = (dense_norm.square() + expert_square).sqrt()
    for params in (dense, experts):
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def expert_replica_ids(state_dict: dict, expert_data_parallel_rank: int) -> dict[str, int]:
    """The checkpoint replica id of each expert key when experts are split: among the edp copies of a tensor (a
    plain one, or a DTensor on the tp mesh), its edp rank; an FSDP2 shard on the edp mesh has no other copy (0)."""
    return {
        key: 0 if _on_expert_data_parallel_mesh(value) else expert_data_parallel_rank
        for key, value in state_dict.items()
        if is_expert_key(key)
    }


def _on_expert_data_parallel_mesh(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and EXPERT_DATA_PARALLEL_DIM in (tensor.device_mesh.mesh_dim_names or ())


def shard_expert_scalar_state(optimizer_state: dict, replica_id: int) -> None:
    """Make the experts' scalar optimizer state (Adam's `step`) ShardedTensors under
    `optimizer.state.<name>.<parameter>`, in place, like their parameter-shaped state.

    Otherwise it would stay in the common part, which rank 0 writes with only its own experts: a checkpoint
    saved with experts split would lack the others' steps. `replica_id`: this rank's index among the ranks
    holding the same experts.
    """
    for param_name, param_state in optimizer_state["state"].items():
        if not is_expert_key(param_name):
            continue
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                key = f"optimizer.state.{name}.{param_name}"
                param_state[name] = ShardedTensor.from_rank_offsets(key, value, replica_id=replica_id)


def complete_expert_param_groups(optimizer_state: dict, model: nn.Module) -> None:
    """List every expert in the param groups of a `named_optimizer_state` (in place), as a rank holding all
    experts would, so the common part of a checkpoint does not depend on which experts rank 0 holds."""
    num_experts = {
        f"{name}.{EXPERTS_MODULE_NAME}.": layer.num_experts
        for name, layer in model.named_modules()
        if isinstance(layer, ExpertParallelLayer)
    }
    pattern = re.compile(rf"(.*\.{EXPERTS_MODULE_NAME}\.)(\d+)\.(.*)")
    for group in optimizer_state["param_groups"]:
        names: list[str] = []
        expanded: set[str] = set()
        for name in group["params"]:
            match = pattern.fullmatch(name)
            if match is None or match[1] not in num_experts:
                names.append(name)
            elif match[1] not in expanded:
                expanded.add(match[1])
                first = f"{match[1]}{match[2]}."
                suffixes = [other[len(first) :] for other in group["params"] if other.startswith(first)]
                names += [
                    f"{match[1]}{expert}.{suffix}" for expert in range(num_experts[match[1]]) for suffix in suffixes
                ]
        group["params"] = names


class ExpertCheckpointRule(CheckpointRule):
    """Experts in a checkpoint: split (`ep` > 1), their copies are the edp ranks' and every expert is listed in
    the optimizer's parameter groups; split or not, their scalar optimizer state (Adam's `step`) is sharded like
    their tensors, copies told apart by their replica rank x tp size + tp rank."""

    def __init__(self, model: nn.Module, dims: ParallelDims) -> None:
        self.model = model
        self.dims = dims

    def replica_ids(self, state_dict: dict) -> dict[str, int]:
        if self.dims.expert_mesh is None:
            return {}
        return expert_replica_ids(state_dict, self.dims.expert_replica_mesh.get_local_rank())

    def finish_optimizer_state(self, sharded: dict) -> None:
        if self.dims.expert_mesh is not None:
            complete_expert_param_groups(sharded, self.model)
        tp_mesh = self.dims.tp_mesh  # the tp ranks hold copies of the experts' scalar state too
        shard_expert_scalar_state(
            sharded, self.dims.expert_replica_mesh.get_local_rank() * tp_mesh.size() + tp_mesh.get_local_rank()
        )


def check_expert_parallel_options(
    expert_model_parallel_size: int,
    expert_tensor_parallel_size: int | None,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    data_parallel_sharding_strategy: str,
) -> int:
    """Configuration-time errors for `MegatronStrategy`'s expert options (combinations not supported yet).

    Returns the expert tensor-parallel size: `expert_tensor_parallel_size`, by default (None) the
    `tensor_model_parallel_size`, as in Megatron-Core.
    """
    if expert_model_parallel_size < 1:
        raise ValueError(f"MegatronStrategy(expert_model_parallel_size={expert_model_parallel_size}): use 1 or more")
    tp = tensor_model_parallel_size
    if expert_tensor_parallel_size is None:
        expert_tensor_parallel_size = tp
    if expert_tensor_parallel_size not in (1, tp):
        raise ValueError(
            f"MegatronStrategy(expert_tensor_parallel_size={expert_tensor_parallel_size}) with "
            f"tensor_model_parallel_size={tp}: experts are sharded over the tensor-parallel ranks "
            f"(expert_tensor_parallel_size={tp}, the default) or held whole on each of them (1); other sizes are "
            "not supported"
        )
    if pipeline_model_parallel_size > 1 and expert_tensor_parallel_size != tp:
        raise ValueError(
            f"MegatronStrategy(expert_tensor_parallel_size={expert_tensor_parallel_size}) with "
            "pipeline_model_parallel_size > 1 is not supported yet; leave it None (experts sharded like the "
            "dense layers)"
        )
    if expert_model_parallel_size == 1:
        return expert_tensor_parallel_size
    if data_parallel_sharding_strategy == "optim":
        raise ValueError(
            "MegatronStrategy: expert_model_parallel_size > 1 does not support data_parallel_sharding_strategy="
            "'optim' (ZeRO-1) yet; use 'no_shard', 'optim_grads' or 'optim_grads_params'"
        )
    if pipeline_model_parallel_size > 1:
        raise ValueError(
            "MegatronStrategy: pipeline_model_parallel_size > 1 with expert_model_parallel_size > 1 is not "
            "supported yet; use one of them"
        )
    return expert_tensor_parallel_size

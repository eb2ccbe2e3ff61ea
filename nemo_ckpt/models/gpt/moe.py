"""Mixture of experts (Megatron-Core's `MoELayer`): a top-k router, SwiGLU experts, an optional shared expert.

Config names are Megatron-Core's (`GPTConfig.num_moe_experts`, `moe_router_topk`, ...). Routing follows
Megatron's `topk_softmax_with_capacity`: softmax over the top-k logits (or top-k of the softmax with
`moe_router_pre_softmax`, or normalized top-k sigmoid scores); with `moe_expert_capacity_factor` each expert takes
at most ceil(tokens x top-k / experts x factor) tokens of the micro-batch, dropping the lowest-probability ones
(`moe_token_drop_policy="probs"`) or the last ones (`"position"`); dropless otherwise. Expert outputs are weighted
by the routing probabilities and summed.

The load-balancing loss (`moe_router_load_balancing_type="aux_loss"`, Switch Transformer's) counts the tokens of
the whole step across data-parallel ranks (Megatron's `global_aux_loss`), so it does not depend on how the batch
is split; the z-loss is per token. Both reach the gradients through `AuxLossAutoScaler` (no change to the main
loss) and are kept for logging (`moe_metrics`).

Experts live in `experts` keyed by global expert id (`experts.{id}.gate_proj.weight`), so checkpoints do not
depend on the expert-parallel size. A rank runs its experts one after another on their contiguous token blocks
(on GPU, a grouped GEMM such as `torch._grouped_mm` or Transformer Engine's GroupedLinear would do it in one
kernel); with expert parallelism, tokens travel to the experts' ranks by all-to-all
(`nemo_ckpt.parallel.expert_parallel`).

With tensor parallelism (the GPT's plan, `nemo_ckpt.models.gpt.parallelize`), every tp rank routes the same
tokens (the layer's input is gathered over tp) with a replicated router; each expert is either sharded like the
dense MLP (`expert_tensor_parallel`: Megatron's expert_tensor_parallel_size = tensor_model_parallel_size), its
outputs partial sums over tp, or held whole by every tp rank (expert_tensor_parallel_size = 1).
`TensorParallelOutput` then brings the routed output to the layout of the activations between blocks.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from nemo_ckpt.parallel.expert_parallel import combine, dispatch

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "none")
TOKEN_DROP_POLICIES = ("probs", "position")


def moe_layer_pattern(config: Any) -> list[bool]:
    """Which layers are MoE layers: `moe_layer_freq` N makes every N-th layer (0, N, 2N, ...) one, as in
    Megatron-Core; a list of 0/1 of length `num_layers` says it per layer. All dense without `num_moe_experts`."""
    if not config.num_moe_experts:
        return [False] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [index % freq == 0 for index in range(config.num_layers)]
    return [bool(flag) for flag in freq]


def validate_moe_config(config: Any) -> None:
    """Clear errors for MoE settings of a `GPTConfig` that cannot work."""
    if config.num_moe_experts is None:
        return
    experts, topk = config.num_moe_experts, config.moe_router_topk
    if experts < 1:
        raise ValueError(f"GPTConfig.num_moe_experts={experts}: use 1 or more experts, or None for a dense model")
    if not 1 <= topk <= experts:
        raise ValueError(
            f"GPTConfig.moe_router_topk={topk} must be between 1 and num_moe_experts={experts} "
            "(each token goes to top-k distinct experts)"
        )
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"GPTConfig.moe_layer_freq={freq}: use 1 (every layer MoE) or more")
    elif len(freq) != config.num_layers or any(flag not in (0, 1) for flag in freq):
        raise ValueError(
            f"GPTConfig.moe_layer_freq={freq}: a list must hold one 0 (dense) or 1 (MoE) per layer "
            f"(num_layers={config.num_layers})"
        )
    choices = {
        "moe_router_score_function": SCORE_FUNCTIONS,
        "moe_router_load_balancing_type": LOAD_BALANCING_TYPES,
        "moe_token_drop_policy": TOKEN_DROP_POLICIES,
    }
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"GPTConfig.{name}={getattr(config, name)!r}: choose one of {allowed}")
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor <= 0:
        raise ValueError(
            f"GPTConfig.moe_expert_capacity_factor={factor} must be > 0 (e.g. 1.0), or None for dropless routing"
        )
    if config.moe_aux_loss_coeff < 0 or (config.moe_z_loss_coeff or 0) < 0:
        raise ValueError("GPTConfig.moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0")
    if config.moe_ffn_hidden_size is not None and config.moe_ffn_hidden_size < 1:
        raise ValueError(f"GPTConfig.moe_ffn_hidden_size={config.moe_ffn_hidden_size} must be 1 or more")


class AuxLossAutoScaler(torch.autograd.Function):
    """Megatron's `MoEAuxLossAutoScaler`: returns `output` unchanged and gives `aux_loss` a gradient of 1 in
    backward, as if it had been added to the loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """Router math runs in fp32 (or the input's dtype if wider), as Megatron's router does."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing probabilities [tokens, experts] (zero where not routed) and the routing map (bool, same shape)."""
    logits = at_least_fp32(logits)
    if score_function == "softmax" and pre_softmax:
        top_probs, top_indices = torch.softmax(logits, dim=-1).topk(topk, dim=-1)
    elif score_function == "softmax":
        top_logits, top_indices = logits.topk(topk, dim=-1)
        top_probs = torch.softmax(top_logits, dim=-1)
    else:
        top_probs, top_indices = torch.sigmoid(logits).topk(topk, dim=-1)
        if topk > 1:
            top_probs = top_probs / (top_probs.sum(dim=-1, keepdim=True) + 1e-20)
    probs = torch.zeros_like(logits).scatter(1, top_indices, top_probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_indices, True)
    if capacity_factor is None:
        return probs, routing_map
    num_tokens, num_experts = logits.shape
    capacity = min(num_tokens, math.ceil(num_tokens * topk / num_experts * capacity_factor))
    if drop_policy == "probs":
        kept = probs.topk(capacity, dim=0).indices
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    else:
        keep = routing_map.long().cumsum(dim=0) <= capacity
    routing_map = routing_map & keep
    return probs * routing_map, routing_map


def switch_aux_loss(
    scores: torch.Tensor, tokens_per_expert: torch.Tensor, total_tokens: int, topk: int, coeff: float
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss from this rank's router scores [tokens, experts] and the token
    counts per expert over `total_tokens` tokens: coeff x experts / (tokens^2 x topk) x sum_e P_e f_e."""
    num_experts = scores.shape[1]
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (num_experts * coeff / (total_tokens**2 * topk))


class TopKRouter(nn.Module):
    """The router's linear map (`router.weight` [experts, hidden], Megatron's name and normal(0, std) init)."""

    def __init__(self, hidden_size: int, num_experts: int, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens, self.weight)


class GroupedExperts(nn.ModuleDict):
    """This rank's experts keyed by global id; `forward` runs each on its contiguous block of tokens."""

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        blocks = tokens.split(tokens_per_expert)
        return torch.cat([expert(block) for expert, block in zip(self.values(), blocks)])


@dataclass(frozen=True)
class TensorParallelOutput:
    """The routed output's layout over the `mesh` (tp) ranks, `Partial` (experts sharded) or `Replicate` (whole
    experts), and the layout the layer's output needs (`Shard(1)` with sequence parallelism, else `Replicate`)."""

    mesh: DeviceMesh
    routed: Placement
    output: Placement

    def __call__(self, routed: torch.Tensor) -> torch.Tensor:
        """This rank's part of the routed output [batch, seq, hidden] in the output layout (a reduction over tp
        of partial sums, a sequence shard of a replicated output)."""
        tensor = DTensor.from_local(routed, self.mesh, [self.routed], run_check=False)
        return tensor.redistribute(self.mesh, [self.output]).to_local()

    def routing_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """`probs` that weight the experts' outputs: the same values; with partial outputs, their gradients summed
        over tp (each rank's part of d loss / d probs comes from its partial sums)."""
        if not self.routed.is_partial():
            return probs
        tensor = DTensor.from_local(probs, self.mesh, [Replicate()], run_check=False)
        return tensor.to_local(grad_placements=[Partial()])


class MoELayer(nn.Module):
    """Routed SwiGLU experts (plus a shared expert): hidden [batch, seq, hidden] -> the same shape.

    `make_mlp(ffn_hidden_size)` builds one SwiGLU MLP (the GPT's `MLP`), used for every expert and the shared one.
    `expert_tensor_parallel`: with tensor parallelism, shard each expert over tp (else every tp rank holds it whole).
    """

    def __init__(self, config: Any, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.num_experts = config.num_moe_experts
        self.router = TopKRouter(config.hidden_size, self.num_experts, config.init_method_std)
        ffn_size = config.moe_ffn_hidden_size or config.ffn_hidden_size
        self.experts = GroupedExperts({str(index): make_mlp(ffn_size) for index in range(self.num_experts)})
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = make_mlp(config.moe_shared_expert_intermediate_size)
        self.data_parallel_group: dist.ProcessGroup | None = None
        self.expert_parallel_group: dist.ProcessGroup | None = None
        self.expert_tensor_parallel = True
        self.tensor_parallel_output: TensorParallelOutput | None = None
        self.last_metrics: dict[str, torch.Tensor] = {}

    @property
    def local_expert_ids(self) -> list[int]:
        return [int(key) for key in self.experts]

    def set_process_groups(
        self, data_parallel_group: dist.ProcessGroup | None, expert_parallel_group: dist.ProcessGroup | None
    ) -> None:
        """Ranks reading different tokens (aux-loss statistics) and ranks the experts are split over."""
        self.data_parallel_group = data_parallel_group
        self.expert_parallel_group = expert_parallel_group

    def keep_experts(self, expert_ids: range) -> None:
        for key in list(self.experts):
            if int(key) not in expert_ids:
                del self.experts[key]

    def set_tensor_parallel(self, tp_mesh: DeviceMesh, output_placement: Placement) -> None:
        """Run over `tp_mesh` (the tensor-parallel plan has placed the parameters); the layer's output goes out
        in `output_placement`, the routed experts' partial (sharded) or whole outputs reduced or split to it."""
        routed = Partial() if self.expert_tensor_parallel else Replicate()
        self.tensor_parallel_output = TensorParallelOutput(tp_mesh, routed, output_placement)

    def _global_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.data_parallel_group is not None and self.data_parallel_group.size() > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, group=self.data_parallel_group)
        return tensor

    def _router_losses(
        self, logits: torch.Tensor, routing_map: torch.Tensor, tokens_per_expert: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor:
        """Attach the load-balancing and z-losses to `output`'s backward; record them."""
        config = self.config
        if config.moe_router_load_balancing_type == "aux_loss" and config.moe_aux_loss_coeff > 0:
            if config.moe_expert_capacity_factor is not None:  # the loss balances the routing before dropping
                _, routing_map = topk_routing(logits, config.moe_router_topk, config.moe_router_score_function)
            counts = self._global_sum(routing_map.sum(dim=0).float())
            ranks = 1 if self.data_parallel_group is None else self.data_parallel_group.size()
            if config.moe_router_score_function == "softmax":
                scores = torch.softmax(at_least_fp32(logits), dim=-1)
            else:
                scores = torch.sigmoid(at_least_fp32(logits))
                scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
            # this rank's share of the global loss, x ranks: gradients are averaged over them
            aux_loss = ranks * switch_aux_loss(
                scores, counts, logits.shape[0] * ranks, config.moe_router_topk, config.moe_aux_loss_coeff
            )
            output = AuxLossAutoScaler.apply(output, aux_loss)
            self.last_metrics["load_balancing_loss"] = aux_loss.detach()
        if config.moe_z_loss_coeff:
            z_loss = torch.logsumexp(at_least_fp32(logits), dim=-1).square().mean() * config.moe_z_loss_coeff
            output = AuxLossAutoScaler.apply(output, z_loss)
            self.last_metrics["z_loss"] = z_loss.detach()
        self.last_metrics["tokens_per_expert"] = self._global_sum(tokens_per_expert.detach().float())
        return output

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        config = self.config
        tokens = hidden.reshape(-1, hidden.shape[-1])
        logits = self.router(tokens)
        probs, routing_map = topk_routing(
            logits,
            config.moe_router_topk,
            config.moe_router_score_function,
            config.moe_router_pre_softmax,
            config.moe_expert_capacity_factor,
            config.moe_token_drop_policy,
        )
        # (token, expert) pairs grouped by expert, tokens ascending within an expert (Megatron's permute)
        by_expert = routing_map.t()
        token_ids = torch.arange(tokens.shape[0], device=tokens.device).expand_as(by_expert)[by_expert]
        pair_probs = probs.t()[by_expert]
        if self.tensor_parallel_output is not None:
            pair_probs = self.tensor_parallel_output.routing_probs(pair_probs)
        tokens_per_expert = by_expert.sum(dim=1)
        permuted = tokens[token_ids]
        if self.expert_parallel_group is None:
            expert_output = self.experts(permuted, tokens_per_expert.tolist())
        else:
            received, dispatched = dispatch(permuted, tokens_per_expert, self.expert_parallel_group)
            local_output = self.experts(received, dispatched.received_counts.sum(dim=0).tolist())
            expert_output = combine(local_output, dispatched, self.expert_parallel_group)
        weighted = expert_output * pair_probs.unsqueeze(1).to(expert_output.dtype)
        output = torch.zeros_like(tokens).index_add(0, token_ids, weighted.to(tokens.dtype)).view_as(hidden)
        if self.tensor_parallel_output is not None:
            output = self.tensor_parallel_output(output)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden)
        return self._router_losses(logits, routing_map, tokens_per_expert, output)


def moe_metrics(model: nn.Module) -> dict[str, torch.Tensor]:
    """Of the last forward, over the MoE layers: the mean load-balancing and z-losses, and the fewest and most
    tokens any expert of any layer received (counted over data-parallel ranks)."""
    layers = [module for module in model.modules() if isinstance(module, MoELayer) and module.last_metrics]
    if not layers:
        return {}
    metrics = {}
    for name in ("load_balancing_loss", "z_loss"):
        values = [layer.last_metrics[name] for layer in layers if name in layer.last_metrics]
        if values:
            metrics[name] = torch.stack(values).mean()
    counts = torch.stack([layer.last_metrics["tokens_per_expert"] for layer in layers])
    metrics["tokens_per_expert_min"] = counts.min()
    metrics["tokens_per_expert_max"] = counts.max()
    return metrics


def expert_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group the model's experts are split over (None: every rank holds all experts)."""
    return next((m.expert_parallel_group for m in model.modules() if isinstance(m, MoELayer)), None)


def active_mlp_weights(config: Any) -> int:
    """The MLP matmul weights one token goes through, over all layers: dense MLPs, and in MoE layers the router,
    `moe_router_topk` experts and the shared expert (for FLOPs)."""
    hidden = config.hidden_size
    pattern = moe_layer_pattern(config)
    dense = 3 * hidden * config.ffn_hidden_size * pattern.count(False)
    if not config.num_moe_experts:
        return dense
    routed = (config.moe_ffn_hidden_size or config.ffn_hidden_size) * config.moe_router_topk
    moe = 3 * hidden * (routed + (config.moe_shared_expert_intermediate_size or 0)) + hidden * config.num_moe_experts
    return dense + moe * pattern.count(True)

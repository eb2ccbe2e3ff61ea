"""Context parallelism: sequences split over the `cp` ranks, self-attention as a ring of K/V exchanges.

Megatron-Core's layout for causal attention: the sequence is cut into 2C chunks and cp rank r holds chunks r and
2C-1-r, so every rank gets the same share of the causal triangle (`load_balanced_positions`, `split_batch`). RoPE
positions stay global (the batch gains `position_ids`).

`ContextParallel.attention(q, k, v)` is the attention of the local queries against the whole sequence's keys and
values, with an exact (log-sum-exp) merge of per-chunk partial results:

- `p2p` (Megatron's default): C steps; at each, the K/V chunk pair this rank holds travels on to the next ring
  neighbour (`isend`/`irecv` started before this step's attention, waited after it), so communication hides
  under compute. Backward goes round the ring again, the dK/dV accumulators travelling with the K/V and reaching
  their owner after a last hop.
- `all_gather`: K/V all-gathered once (simpler, one collective, C x the K/V memory), dK/dV summed back.

Per chunk pair the causal mask is either the diagonal one (own chunks), the first key chunk for all queries
(keys from a lower rank) or all keys for the second query chunk (keys from a higher rank); nothing is computed
for the skipped quarters. Grouped-query attention is native (K/V travel with their `num_query_groups` heads).
The arithmetic is fp32 whatever the inputs' dtype or autocast (outputs and gradients in the inputs' dtype).

Under pipeline parallelism the micro-batches carry split sequences; each stage's attention runs the ring over the
cp ranks of its stage, and `GlobalPositions` gives each stage the global RoPE positions the schedule cannot pass.

torch's `torch.distributed.tensor.experimental.context_parallel` does not run here: on CPU it raises
"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"
(torch 2.13), and it exposes neither the exchange schedule nor Megatron's comm types, so the ring is written on
`torch.distributed` point-to-point operations (gloo on CPU, NCCL on GPU).
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.profiler import record_function

CP_COMM_TYPES = ("p2p", "all_gather")
"""Megatron-Core's `cp_comm_type` values implemented here (`a2a` and `a2a+p2p` are not)."""

_KV_TAG, _DKV_TAG = 7100, 7101


def validate_cp_comm_type(cp_comm_type: str | None) -> str:
    """`cp_comm_type` (None: `p2p`, as in Megatron-Core), or a clear error."""
    comm_type = cp_comm_type or "p2p"
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r} is not supported; use one of {list(CP_COMM_TYPES)} "
            "('p2p': ring exchange overlapped with attention, 'all_gather': K/V gathered once); "
            "Megatron's 'a2a' and 'a2a+p2p' (Ulysses) are not implemented here"
        )
    return comm_type


def validate_sequence_length(seq_length: int, context_parallel_size: int, sequence_shards: int = 1) -> None:
    """Raise unless `seq_length` splits into 2 x `context_parallel_size` chunks (x tensor-parallel shards with
    sequence parallelism)."""
    divisor = 2 * context_parallel_size * sequence_shards
    if seq_length % divisor:
        shards = f" x tensor_model_parallel_size={sequence_shards} (sequence_parallel)" if sequence_shards > 1 else ""
        raise ValueError(
            f"seq_length={seq_length} is not divisible by 2 x context_parallel_size={context_parallel_size}{shards} "
            f"= {divisor}: context parallelism cuts each sequence into 2 x context_parallel_size equal chunks; "
            f"choose a seq_length that is a multiple of {divisor}"
        )


def load_balanced_positions(
    seq_length: int, context_parallel_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions cp rank `cp_rank` holds: chunks `cp_rank` and `2C-1-cp_rank` of 2C."""
    validate_sequence_length(seq_length, context_parallel_size)
    chunk = seq_length // (2 * context_parallel_size)
    second = 2 * context_parallel_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def split_batch(batch: dict[str, Any], context_parallel_size: int, cp_rank: int, seq_dim: int = 1) -> dict[str, Any]:
    """This cp rank's part of `batch`: every tensor with a sequence dimension (`tokens`, `labels`, `loss_mask`,
    `position_ids`, ...) indexed along `seq_dim` with `load_balanced_positions`; `position_ids` (the global
    positions, [local seq]) added when the batch has none."""
    seq_length = batch["tokens"].shape[seq_dim]
    positions = load_balanced_positions(seq_length, context_parallel_size, cp_rank, batch["tokens"].device)
    local = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > seq_dim and value.shape[seq_dim] == seq_length:
            local[key] = value.index_select(seq_dim, positions)
        elif isinstance(value, torch.Tensor) and key == "position_ids" and value.dim() == 1:
            local[key] = value.index_select(0, positions)
        else:
            local[key] = value
    local.setdefault("position_ids", positions)
    return local


@dataclass
class ContextParallel:
    """Attention over a sequence split on `group` (the cp ranks) in the load-balanced layout.

    `comm_type`: `p2p` or `all_gather`. `overlap`: start each K/V exchange before the chunk's attention and wait
    after it (False: wait first; the same numbers, for comparison).
    """

    group: ProcessGroup
    comm_type: str = "p2p"
    overlap: bool = True
    rank: int = field(init=False)
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.comm_type = validate_cp_comm_type(self.comm_type)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
        """Scaled dot-product attention of local `q` [batch, heads, seq, dim] against the whole sequence's keys
        and values, of which `k`, `v` [batch, groups, seq, dim] are this rank's chunks; heads divisible by groups."""
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
        if q.shape[2] % 2:
            raise ValueError(f"the local sequence ({q.shape[2]}) must hold two equal chunks")
        return _RingAttention.apply(q, k, v, self, causal)


class GlobalPositions:
    """A forward pre-hook (`register_forward_pre_hook(..., with_kwargs=True)`) passing `position_ids`, the global
    positions of this cp rank's chunks, to a module called without them: a pipeline stage, which the schedule
    calls with its input alone. `local_length(module, input)`: the length of this cp rank's part of the sequence
    (before any further split of the input, e.g. by sequence parallelism)."""

    def __init__(self, cp: ContextParallel, local_length: Callable[[nn.Module, torch.Tensor], int]) -> None:
        self.cp, self.local_length = cp, local_length

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if kwargs.get("position_ids") is not None:
            return args, kwargs
        length = self.local_length(module, args[0]) * self.cp.size
        positions = load_balanced_positions(length, self.cp.size, self.cp.rank, args[0].device)
        return args, {**kwargs, "position_ids": positions}


def token_mean(losses: torch.Tensor, loss_mask: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The mean of per-token `losses` over the unmasked tokens of the whole sequences split over `group`: sums
    and counts all-reduced (differentiably: each rank's gradient is scaled by the group size, which the gradient
    average over dp x cp divides out again, as Megatron's `loss * cp_size`)."""
    totals = torch.stack([(losses * loss_mask).sum(), loss_mask.sum()])
    totals = differentiable_all_reduce(totals, group=group)
    return totals[0] / totals[1].clamp(min=1.0)


# --- one chunk pair ------------------------------------------------------------------------------------------


def _chunk_pair(rank: int, source: int, causal: bool, local_seq: int) -> tuple[slice, slice, bool]:
    """Which queries meet which of `source`'s keys, and whether with the diagonal causal mask."""
    everything, half = slice(0, local_seq), local_seq // 2
    if not causal:
        return everything, everything, False
    if source == rank:
        return everything, everything, True
    if source < rank:  # both query chunks come after the source's first chunk, before its second
        return everything, slice(0, half), False
    return slice(half, local_seq), everything, False  # only the second query chunk follows both key chunks


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(mask, float("-inf"))
    return scores


def _pair_forward(q, k, v, scale, causal) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and log-sum-exp of queries [b, g, h/g, s, d] against keys/values [b, g, 1, s, d]."""
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


def _pair_backward(q, k, v, dout, lse, delta, scale, causal) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of one chunk pair given the final log-sum-exp and delta = rowsum(dout * out)."""
    probs = torch.exp(_scores(q, k, scale, causal) - lse)
    dv = torch.matmul(probs.transpose(-1, -2), dout).sum(dim=2, keepdim=True)
    dscores = probs * (torch.matmul(dout, v.transpose(-1, -2)) - delta)
    dq = torch.matmul(dscores, k) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial result into (out, lse) in place (online softmax)."""
    new_lse = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new_lse)).add_(part * torch.exp(part_lse - new_lse))
    lse.copy_(new_lse)


# --- communication ---------------------------------------------------------------------------------------------


class _Exchange:
    """Send one tensor to the next ring neighbour and receive its like from the previous, asynchronously."""

    def __init__(self, tensor: torch.Tensor, cp: ContextParallel, tag: int) -> None:
        self.received = torch.empty_like(tensor)
        with record_function("context_parallel.exchange_start"):
            self.works = [
                dist.isend(tensor, group=cp.group, group_dst=(cp.rank + 1) % cp.size, tag=tag),
                dist.irecv(self.received, group=cp.group, group_src=(cp.rank - 1) % cp.size, tag=tag),
            ]
        self.sent = tensor  # keep alive until the send completes

    def wait(self) -> torch.Tensor:
        with record_function("context_parallel.exchange_wait"):
            for work in self.works:
                work.wait()
        return self.received


def _gather_kv(kv: torch.Tensor, cp: ContextParallel) -> list[torch.Tensor]:
    gathered = [torch.empty_like(kv) for _ in range(cp.size)]
    with record_function("context_parallel.all_gather"):
        dist.all_gather(gathered, kv, group=cp.group)
    return gathered


def _sources(cp: ContextParallel) -> list[int]:
    """The order in which a rank meets the cp ranks' chunks: itself, then backwards round the ring."""
    return [(cp.rank - step) % cp.size for step in range(cp.size)]


# --- the autograd function -----------------------------------------------------------------------------------


def _without_autocast(method: Callable) -> Callable:
    """Run an autograd function's forward or backward with autocast off: the ring computes in fp32 (inputs
    upcast, results cast back) under bf16 autocast too, and forward and backward do the same arithmetic."""

    @functools.wraps(method)
    def run(ctx: Any, tensor: torch.Tensor, *args: Any) -> Any:
        with torch.autocast(tensor.device.type, enabled=False):
            return method(ctx, tensor, *args)

    return run


class _RingAttention(torch.autograd.Function):
    @staticmethod
    @_without_autocast
    def forward(ctx, q, k, v, cp: ContextParallel, causal: bool):
        batch, heads, seq, dim = q.shape
        groups = k.shape[1]
        scale = 1.0 / math.sqrt(dim)
        q5 = q.float().reshape(batch, groups, heads // groups, seq, dim)
        kv = torch.stack([k, v]).unsqueeze(3).contiguous()  # [2, b, g, 1, s, d], the exchanged unit
        out = torch.zeros_like(q5)
        lse = torch.full((*q5.shape[:-1], 1), float("-inf"), dtype=torch.float32, device=q.device)
        gathered = _gather_kv(kv, cp) if cp.comm_type == "all_gather" else None
        for step, source in enumerate(_sources(cp)):
            held = gathered[source] if gathered is not None else kv
            exchange = _Exchange(kv, cp, _KV_TAG) if gathered is None and step < cp.size - 1 else None
            if exchange is not None and not cp.overlap:
                kv = exchange.wait()
            rows, cols, diagonal = _chunk_pair(cp.rank, source, causal, seq)
            with record_function("context_parallel.attention"):
                part, part_lse = _pair_forward(
                    q5[..., rows, :], held[0, ..., cols, :].float(), held[1, ..., cols, :].float(), scale, diagonal
                )
                _merge(out[..., rows, :], lse[..., rows, :], part, part_lse)
            if exchange is not None and cp.overlap:
                kv = exchange.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.causal, ctx.scale = cp, causal, scale
        return out.view(batch, heads, seq, dim).to(q.dtype)

    @staticmethod
    @_without_autocast
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        batch, heads, seq, dim = q.shape
        q5 = q.float().reshape(out.shape)
        dout = grad_out.float().reshape(out.shape)
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q5)
        kv = torch.stack([k, v]).unsqueeze(3).contiguous()
        gathered = _gather_kv(kv, cp) if cp.comm_type == "all_gather" else None
        dkv_parts = []
        travelling = None  # dK/dV of the previous step's source, on its way round the ring
        for step, source in enumerate(_sources(cp)):
            held = gathered[source] if gathered is not None else kv
            exchanges = {}
            if gathered is None and step < cp.size - 1:
                exchanges["kv"] = _Exchange(kv, cp, _KV_TAG)
            if travelling is not None:
                exchanges["dkv"] = _Exchange(travelling, cp, _DKV_TAG)
            received = {} if cp.overlap else {name: exchange.wait() for name, exchange in exchanges.items()}
            rows, cols, diagonal = _chunk_pair(cp.rank, source, ctx.causal, seq)
            dkv = torch.zeros(held.shape, dtype=torch.float32, device=held.device)
            with record_function("context_parallel.attention_backward"):
                part_dq, part_dk, part_dv = _pair_backward(
                    q5[..., rows, :],
                    held[0, ..., cols, :].float(),
                    held[1, ..., cols, :].float(),
                    dout[..., rows, :],
                    lse[..., rows, :],
                    delta[..., rows, :],
                    ctx.scale,
                    diagonal,
                )
                dq[..., rows, :] += part_dq
                dkv[0, ..., cols, :] = part_dk
                dkv[1, ..., cols, :] = part_dv
            if cp.overlap:
                received = {name: exchange.wait() for name, exchange in exchanges.items()}
            kv = received.get("kv", kv)
            if "dkv" in received:
                dkv += received["dkv"]
            if gathered is None:
                travelling = dkv
            else:
                dkv_parts.append((source, dkv))
        if gathered is None:
            own = _Exchange(travelling, cp, _DKV_TAG).wait() if cp.size > 1 else travelling
        else:
            stacked = torch.stack([dkv for _, dkv in sorted(dkv_parts, key=lambda part: part[0])])
            with record_function("context_parallel.all_reduce"):
                dist.all_reduce(stacked, group=cp.group)
            own = stacked[cp.rank]
        own = own.squeeze(3)
        return dq.view(batch, heads, seq, dim).to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


# --- strategy helpers ----------------------------------------------------------------------------------------


def check_context_parallel_options(context_parallel_size: int, cp_comm_type: str | None) -> str:
    """Configuration-time errors for `MegatronStrategy`'s context-parallel options; the comm type to use."""
    if context_parallel_size < 1:
        raise ValueError(f"MegatronStrategy(context_parallel_size={context_parallel_size}): use 1 or more")
    return validate_cp_comm_type(cp_comm_type)


def apply_context_parallel(
    model: Any, cp_mesh: DeviceMesh, data_context_mesh: DeviceMesh, cp_comm_type: str, sequence_shards: int = 1
) -> None:
    """Hand the cp ranks to a model that supports context parallelism (`parallelize_context`, as nemo_ckpt's
    `GPTModel` has); a model without it is an error when `cp_mesh` has more than one rank."""
    if not hasattr(model, "parallelize_context"):
        if cp_mesh.size() > 1:
            raise TypeError(
                f"context_parallel_size={cp_mesh.size()} needs a model whose attention runs split over the sequence "
                f"(a `parallelize_context` method, as nemo_ckpt's GPTModel has); {type(model).__name__} has none: "
                "use context_parallel_size=1"
            )
        return
    model.parallelize_context(cp_mesh, data_context_mesh, cp_comm_type, sequence_shards)

"""Context parallelism mechanics on gloo: the load-balanced split, ring / all-gather attention against full
attention (outputs and gradients), and the overlap of the K/V exchange with attention."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.parallel.context_parallel import (
    ContextParallel,
    load_balanced_positions,
    split_batch,
    validate_cp_comm_type,
    validate_sequence_length,
)
from tests.helpers.distributed import run_distributed


def test_load_balanced_positions_are_megatrons_chunks():
    # 16 tokens, C=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    everything = torch.cat([load_balanced_positions(24, 3, rank) for rank in range(3)])
    assert sorted(everything.tolist()) == list(range(24))


def test_split_batch_indexes_every_sequence_tensor_and_adds_global_positions():
    batch = {"tokens": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 100, "loss_mask": None}
    batch["loss_mask"] = torch.ones(2, 8)
    local = split_batch(batch, 2, 1)
    assert local["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert local["labels"].tolist() == [[102, 103, 104, 105], [110, 111, 112, 113]]
    assert local["loss_mask"].shape == (2, 4)
    assert local["position_ids"].tolist() == [2, 3, 4, 5]


def test_bad_sequence_length_and_comm_type_are_named():
    with pytest.raises(ValueError, match=r"seq_length=30 is not divisible by 2 x context_parallel_size=4 = 8"):
        validate_sequence_length(30, 4)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 \(sequence_parallel\) = 8"):
        validate_sequence_length(36, 2, sequence_shards=2)
    with pytest.raises(ValueError, match=r"cp_comm_type='a2a' is not supported.*'p2p', 'all_gather'"):
        validate_cp_comm_type("a2a")
    assert validate_cp_comm_type(None) == "p2p"


ATTENTION_CASES = {
    2: [
        (4, 4, True, "p2p"),
        (4, 2, True, "p2p"),
        (4, 2, False, "p2p"),
        (4, 1, True, "all_gather"),
        (4, 2, False, "all_gather"),
    ],
    4: [(4, 2, True, "p2p"), (4, 4, False, "p2p")],
}
"""world size -> (query heads, key/value heads, causal, cp_comm_type) cases, all run in one spawn."""


def _excess_over_tolerance(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-6) -> float:
    """max(|actual - expected| - tolerance * (1 + |expected|)): <= 0 when within 1e-6 (absolute and relative)."""
    return ((actual - expected).abs() - tolerance * (1 + expected.abs())).max().item()


def _compare_with_full_attention(rank: int, world_size: int) -> tuple[dict[tuple, float], dict | None]:
    """Per case: how far this rank's ring attention output and q/k/v gradients exceed the 1e-6 tolerance
    against its rows of full attention on one process (fp32)."""
    group = init_device_mesh("cpu", (world_size,)).get_group()
    excess = {}
    for heads, groups, causal, comm_type in ATTENTION_CASES[world_size]:
        cp = ContextParallel(group, comm_type)
        torch.manual_seed(0)
        batch, seq, dim = 2, 8 * world_size, 16
        q = torch.randn(batch, heads, seq, dim, requires_grad=True)
        k = torch.randn(batch, groups, seq, dim, requires_grad=True)
        v = torch.randn(batch, groups, seq, dim, requires_grad=True)
        grad = torch.randn(batch, heads, seq, dim)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != groups)
        expected.backward(grad)

        positions = load_balanced_positions(seq, world_size, rank)
        local = [t.detach()[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
        out = cp.attention(*local, causal=causal)
        out.backward(grad[:, :, positions])
        pairs = [(out, expected.detach())] + [(t.grad, full.grad) for t, full in zip(local, (q, k, v))]
        excess[(heads, groups, causal, comm_type)] = max(
            _excess_over_tolerance(actual, full[:, :, positions]) for actual, full in pairs
        )
    if world_size == 2:  # bf16 inputs: the ring computes in fp32 and returns bf16, as close as bf16 allows
        q, k, v = (torch.randn(1, heads, 16, 16, dtype=torch.bfloat16) for heads in (4, 2, 2))
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        positions = load_balanced_positions(16, 2, rank)
        out = ContextParallel(group).attention(*(t[:, :, positions] for t in (q, k, v)))
        assert out.dtype == torch.bfloat16
        excess["bf16"] = _excess_over_tolerance(out.float(), expected[:, :, positions], tolerance=1e-2)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed training: the ring still computes in fp32
            autocast_out = ContextParallel(group).attention(*(t[:, :, positions] for t in (q, k, v)))
        excess["bf16_autocast"] = (autocast_out.float() - out.float()).abs().max().item()  # 0: bit-identical
        excess["loss"] = _split_loss_excess(rank, init_device_mesh("cpu", (2,)))
    return excess, _overlap_trace(rank, group) if world_size == 2 else None


def _split_loss_excess(rank: int, mesh) -> float:
    """`GPTModel.loss` of a sequence split over 2 cp ranks (with `calculate_per_token_loss`): the value and the
    cp-averaged gradients (as DDP over dp x cp averages them) against the whole sequence on one model."""
    config = gpt_config("tiny", seq_length=16, calculate_per_token_loss=True)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPTModel(config))
        models[-1].configure_model()
    whole, split = models
    split.parallelize_context(mesh, mesh, "p2p")
    tokens = torch.randint(config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss_mask = (torch.arange(16) % 3 != 0).float().expand(2, 16)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask}
    expected = whole.loss(batch)
    expected.backward()
    loss = split.loss(split_batch(batch, 2, rank))
    loss.backward()
    excess = [_excess_over_tolerance(loss.detach(), expected.detach())]
    for param, reference in zip(split.parameters(), whole.parameters()):
        dist.all_reduce(param.grad)
        excess.append(_excess_over_tolerance(param.grad / 2, reference.grad))
    return max(excess)


SENDER_DELAY_S = 1.0
SPANS = ("context_parallel.exchange_start", "context_parallel.attention", "context_parallel.exchange_wait")


def _overlap_trace(rank: int, group: dist.ProcessGroup) -> dict:
    """Rank 0's profiler spans (us) of its first K/V exchange and attention while rank 1 sends 1 s late, with
    overlap on and off, and whether both give the same output."""
    torch.manual_seed(rank)
    q, k, v = torch.randn(1, 2, 16, 8), torch.randn(1, 1, 16, 8), torch.randn(1, 1, 16, 8)
    spans, outputs = {}, {}
    for overlap in (True, False):
        cp = ContextParallel(group, "p2p", overlap=overlap)
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # started (slow) before the barrier
            dist.barrier(group)
            if rank == 1:
                time.sleep(SENDER_DELAY_S)
            outputs[overlap] = cp.attention(q, k, v)
        events = {}
        for event in prof.events():
            if event.name in SPANS and event.name not in events:
                events[event.name] = (event.time_range.start, event.time_range.end)
        spans[overlap] = events
    return {"spans": spans, "same_output": torch.equal(outputs[True], outputs[False])}


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_equals_full_attention(world_size):
    """Output and gradients within 1e-6 of full attention: C = 2 and 4, causal and not, GQA and not, both
    comm types; bf16 (bit-identical under autocast); and (C = 2) the GPT's loss and gradients on a split sequence
    equal the whole sequence's."""
    results = run_distributed(_compare_with_full_attention, world_size)
    for rank_excess, _ in results:
        special = {"bf16", "bf16_autocast", "loss"}
        assert rank_excess.keys() - special == {tuple(case) for case in ATTENTION_CASES[world_size]}
        assert max(rank_excess.values()) <= 0, rank_excess
    if world_size == 2:
        _assert_exchange_overlaps_attention(results[0][1])


def _assert_exchange_overlaps_attention(trace: dict) -> None:
    """Overlap on: the receive is posted before the attention and still in flight after it (rank 1 sends late);
    overlap off: the attention waits for it. Same output either way."""
    start, attention, wait = (trace["spans"][True][name] for name in SPANS)
    assert start[1] <= attention[0] and attention[1] <= wait[0]
    assert wait[1] - attention[1] > SENDER_DELAY_S * 1e6 / 2, "the receive was in flight during the attention"
    start, attention, wait = (trace["spans"][False][name] for name in SPANS)
    assert start[1] <= wait[0] and wait[1] <= attention[0]
    assert trace["same_output"]

"""`MegatronStrategy(context_parallel_size)` through Lightning: training with sequences split over cp ranks follows
single-process training, and a run resumes across CP sizes with identical weights and optimizer state.

One 20-step run is passed along a chain of layouts: CP=2 (2 ranks, ring attention, full activation recompute)
-> CP=1 (1 rank) -> CP=2 x TP=2 + SP -> CP=2 x DP=2 with FSDP2 (`optim_grads_params`, all_gather comm type),
ZeRO-1 (`optim`) and FSDP2 `optim_grads` -> CP=2 x PP=2 (each 4 ranks). The tiny GPT uses grouped-query
attention (4 heads, 2 groups). The 2-rank and 1-rank spawns also train a few steps in bf16 mixed precision.
"""

import math
from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import RecordLoss, SaveAtStart, StopAndSave, assert_same_checkpoint, fit_tiny_gpt

MAX_STEPS = 20
BF16_STEPS = 5
MODEL = {"num_query_groups": 2}
CP = {"context_parallel_size": 2}


def sharding(strategy: str) -> dict[str, DistributedDataParallelConfig]:
    return {"ddp": DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)}


CHAIN = [  # (world size, last step, strategy options); the CP=2 phase recomputes layers in backward
    (2, 4, CP),
    (1, 6, {}),
    (4, 8, {**CP, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    (4, 11, {**CP, "cp_comm_type": "all_gather", **sharding("optim_grads_params")}),  # 4 ranks: CP=2 x DP=2
    (4, 14, {**CP, **sharding("optim")}),
    (4, 17, {**CP, **sharding("optim_grads")}),
    (4, 20, {**CP, "pipeline_model_parallel_size": 2}),
]


def train_phase(rank: int, world_size: int, phase: int, directory: Path) -> tuple[list[float], int]:
    _, stop_at, strategy_kwargs = CHAIN[phase]
    resume_from = directory / f"step{CHAIN[phase - 1][1]}" if phase else None
    recorder = RecordLoss()
    callbacks = [recorder, StopAndSave(stop_at, directory / f"step{stop_at}")]
    if resume_from is not None:
        callbacks.append(SaveAtStart(directory / f"loaded{CHAIN[phase - 1][1]}"))
    strategy = MegatronStrategy(**strategy_kwargs)
    model = {**MODEL, "recompute_granularity": "full"} if phase == 0 else MODEL
    micro_batch_size = 2 if strategy.pipeline_config.enabled else None  # 1F1B over 2 stages: 2 micro-batches
    fit_tiny_gpt(
        world_size,
        strategy,
        MAX_STEPS,
        callbacks,
        resume_from,
        model_overrides=model,
        micro_batch_size=micro_batch_size,
    )
    return recorder.losses, strategy.parallel_dims.cp_mesh.size()


def train_bf16(world_size: int) -> list[float]:
    """`BF16_STEPS` steps of bf16 mixed precision with every rank a cp rank (1 or 2)."""
    recorder = RecordLoss()
    strategy = MegatronStrategy(context_parallel_size=world_size)
    fit_tiny_gpt(world_size, strategy, BF16_STEPS, [recorder], precision="bf16-mixed", model_overrides=MODEL)
    return recorder.losses


def train_phases(rank: int, world_size: int, phases: list[int], directory: Path) -> tuple:
    """The chain's `phases` one after another in this spawn (same world size); then, on 1 or 2 ranks, the bf16
    run, and on one process the uninterrupted fp32 run (spawns are the slow part of these tests)."""
    results = [train_phase(rank, world_size, phase, directory) for phase in phases]
    bf16 = train_bf16(world_size) if world_size <= 2 else None
    if world_size > 1:
        return results, bf16, None
    recorder = RecordLoss()
    fit_tiny_gpt(1, MegatronStrategy(), MAX_STEPS, [recorder], model_overrides=MODEL)
    return results, bf16, recorder.losses


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, list[float], list[float], dict[int, list[float]]]:
    """The chain's directory, its losses, the uninterrupted fp32 run's and the bf16 runs' by world size."""
    directory = tmp_path_factory.mktemp("cp_chain")
    losses, reference, bf16 = [], None, {}
    phases_by_spawn = [[0], [1], [2, 3, 4, 5, 6]]  # consecutive phases of one world size share a spawn
    for phases in phases_by_spawn:
        world_size = CHAIN[phases[0]][0]
        per_rank = run_distributed(train_phases, world_size, phases, directory)
        reference = per_rank[0][2] or reference
        if per_rank[0][1] is not None:
            assert all(rank_bf16 == per_rank[0][1] for _, rank_bf16, _ in per_rank), "every rank logs the same loss"
            bf16[world_size] = per_rank[0][1]
        for index, phase in enumerate(phases):
            _, stop_at, strategy_kwargs = CHAIN[phase]
            results = [rank_results[index] for rank_results, _, _ in per_rank]
            assert all(cp_size == strategy_kwargs.get("context_parallel_size", 1) for _, cp_size in results)
            assert all(rank_losses == results[0][0] for rank_losses, _ in results), "every rank logs the same loss"
            losses += results[0][0]
            assert len(losses) == stop_at, f"phase {phase} trains up to step {stop_at}"
    return directory, losses, reference, bf16


def test_context_parallel_training_matches_single_process(chain):
    _, losses, reference, _ = chain
    assert reference[-1] < reference[0] - 0.3, "the model learns"
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("phase", range(1, len(CHAIN)))
def test_resume_across_context_parallel_sizes_loads_identical_state(chain, phase):
    directory, _, _, _ = chain
    step = CHAIN[phase - 1][1]
    assert_same_checkpoint(directory / f"step{step}", directory / f"loaded{step}")


def test_bf16_context_parallel_training_follows_one_process(chain):
    _, _, reference, bf16 = chain
    one, split = bf16[1], bf16[2]
    assert len(one) == len(split) == BF16_STEPS
    assert all(math.isfinite(loss) for loss in one + split)
    assert one[0] != reference[0], "bf16 compute, not fp32 (same weights and batch)"
    for losses in (one, split):
        assert losses[-1] < losses[0] - 0.1, "the model learns"
    # Both runs round every matmul to bf16 alike; they differ in attention only: SDPA's bf16 kernel on one
    # process, the ring's fp32 chunk pairs merged in another order on two, each output rounded to bf16 (relative
    # 2^-9, about 2e-3, per element). Over 5 steps that moves the loss by about 2e-4 (5e-4 while autocast still
    # ran the ring's matmuls in bf16); 1e-3 is 5x that and a 200th of what the model learns here (0.2).
    assert split == pytest.approx(one, rel=0, abs=1e-3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"context_parallel_size": 0}, r"context_parallel_size=0\): use 1 or more"),
        ({"context_parallel_size": 2, "cp_comm_type": "a2a"}, r"cp_comm_type='a2a' is not supported"),
    ],
)
def test_bad_context_parallel_options_fail_at_configuration(options: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(**options)

"""`MegatronStrategy(context_parallel_size)` through Lightning: training with sequences split over cp ranks follows
single-process training, and a run resumes across CP sizes with identical weights and optimizer state.

One 20-step run is passed along a chain of layouts: CP=2 (2 ranks, ring attention, full activation recompute)
-> CP=1 (1 rank) -> CP=2 x TP=2 + SP (4 ranks) -> CP=2 x FSDP2 DP=2 with the all_gather comm type (4 ranks).
The tiny GPT uses grouped-query attention (4 heads, 2 groups).
"""

from pathlib import Path
from typing import Any

import pytest

from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import RecordLoss, SaveAtStart, StopAndSave, assert_same_checkpoint, fit_tiny_gpt

MAX_STEPS = 20
MODEL = {"num_query_groups": 2}
CHAIN = [  # (world size, last step, strategy options); the CP=2 phase recomputes layers in backward
    (2, 8, {"context_parallel_size": 2}),
    (1, 10, {}),
    (4, 15, {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
    (
        4,
        20,
        {
            "context_parallel_size": 2,
            "cp_comm_type": "all_gather",
            "ddp": DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params"),
        },
    ),
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
    fit_tiny_gpt(world_size, strategy, MAX_STEPS, callbacks, resume_from, model_overrides=model)
    return recorder.losses, strategy.context_parallel_mesh.size()


def train_phases(rank: int, world_size: int, phases: list[int], directory: Path, reference: bool) -> tuple:
    """The chain's `phases` one after another in this spawn (same world size); then, with `reference`, the
    uninterrupted single-process run (spawns are the slow part of these tests)."""
    results = [train_phase(rank, world_size, phase, directory) for phase in phases]
    if not reference:
        return results, None
    recorder = RecordLoss()
    fit_tiny_gpt(1, MegatronStrategy(), MAX_STEPS, [recorder], model_overrides=MODEL)
    return results, recorder.losses


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, list[float], list[float]]:
    directory = tmp_path_factory.mktemp("cp_chain")
    losses, reference = [], None
    phases_by_spawn = [[0], [1], [2, 3]]  # consecutive phases of one world size share a spawn
    for phases in phases_by_spawn:
        world_size = CHAIN[phases[0]][0]
        per_rank = run_distributed(train_phases, world_size, phases, directory, world_size == 1)
        reference = per_rank[0][1] or reference
        for index, phase in enumerate(phases):
            _, stop_at, strategy_kwargs = CHAIN[phase]
            results = [rank_results[index] for rank_results, _ in per_rank]
            assert all(cp_size == strategy_kwargs.get("context_parallel_size", 1) for _, cp_size in results)
            assert all(rank_losses == results[0][0] for rank_losses, _ in results), "every rank logs the same loss"
            losses += results[0][0]
            assert len(losses) == stop_at, f"phase {phase} trains up to step {stop_at}"
    return directory, losses, reference


def test_context_parallel_training_matches_single_process(chain):
    _, losses, reference = chain
    assert reference[-1] < reference[0] - 0.3, "the model learns"
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("phase", range(1, len(CHAIN)))
def test_resume_across_context_parallel_sizes_loads_identical_state(chain, phase):
    directory, _, _ = chain
    step = CHAIN[phase - 1][1]
    assert_same_checkpoint(directory / f"step{step}", directory / f"loaded{step}")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"context_parallel_size": 0}, r"context_parallel_size=0\): use 1 or more"),
        ({"context_parallel_size": 2, "cp_comm_type": "a2a"}, r"cp_comm_type='a2a' is not supported"),
        (
            {"context_parallel_size": 2, "pipeline_model_parallel_size": 2},
            r"pipeline_model_parallel_size=2 with context_parallel_size=2 is not supported yet",
        ),
        (
            {"context_parallel_size": 2, "expert_model_parallel_size": 2},
            r"context_parallel_size > 1 with expert_model_parallel_size > 1 is not supported yet",
        ),
    ],
)
def test_bad_context_parallel_options_fail_at_configuration(options: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(**options)

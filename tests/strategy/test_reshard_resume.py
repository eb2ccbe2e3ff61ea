"""A checkpoint of any sharding strategy and world size resumes under any other, with identical weights and
optimizer state, and training continues as if uninterrupted.

One run is passed along a chain of layouts, 2 steps each: FSDP2 on 2 ranks -> DDP on 1 -> FSDP2 on 4 (uneven
shards) -> ZeRO-1 on 2 -> FSDP2 without resharding on 1.
"""

from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import assert_same_checkpoint, fit

MAX_STEPS = 10
MODEL = {"ffn_hidden_size": 170}  # 170 rows over 4 ranks: shards of 43, 43, 43 and 41
CHAIN = [(2, "optim_grads_params"), (1, "no_shard"), (4, "optim_grads_params"), (2, "optim"), (1, "optim_grads")]


def train_phase(
    rank: int, world_size: int, strategy: str, stop_at: int, resume_from: Path | None, directory: Path
) -> list[float]:
    return fit(
        world_size,
        {"data_parallel_sharding_strategy": strategy},
        MAX_STEPS,
        ckpt_path=resume_from,
        stop_at=stop_at,
        save_to=directory / f"step{stop_at}",
        save_at_start=directory / f"loaded{stop_at - 2}" if resume_from else None,
        model_overrides=MODEL,
    )


def uninterrupted(rank: int, world_size: int) -> list[float]:
    return fit(world_size, {"data_parallel_sharding_strategy": "no_shard"}, MAX_STEPS, model_overrides=MODEL)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, list[float]]:
    directory = tmp_path_factory.mktemp("chain")
    losses: list[float] = []
    resume_from = None
    for phase, (world_size, strategy) in enumerate(CHAIN):
        stop_at = 2 * (phase + 1)
        per_rank = run_distributed(train_phase, world_size, strategy, stop_at, resume_from, directory)
        assert len(per_rank[0]) == 2, f"{strategy} on {world_size} rank(s) trains 2 more steps"
        losses += per_rank[0]
        resume_from = directory / f"step{stop_at}"
    return directory, losses


@pytest.mark.parametrize("phase", range(1, len(CHAIN)))
def test_resume_loads_identical_weights_and_optimizer_state(chain, phase):
    directory, _ = chain
    saved_at = 2 * phase
    assert_same_checkpoint(directory / f"step{saved_at}", directory / f"loaded{saved_at}")


def test_training_continues_as_if_uninterrupted(chain):
    _, losses = chain
    [reference] = run_distributed(uninterrupted, 1)
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)

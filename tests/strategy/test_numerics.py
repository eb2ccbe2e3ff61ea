"""Every sharding strategy on 2 ranks follows single-process training's loss curve for 20 steps."""

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import fit

STEPS = 20
# each strategy with its communication options on, so they are exercised too
VARIANTS = {
    "no_shard": {"overlap_grad_reduce": True, "bucket_size": 20_000},
    "optim": {"overlap_grad_reduce": True, "overlap_param_gather": True},
    "optim_grads": {"overlap_param_gather": True, "average_in_collective": True},
    "optim_grads_params": {"overlap_param_gather": True, "overlap_grad_reduce": True},
}


def train_each(rank: int, world_size: int, strategies: list[str]) -> dict[str, list[float]]:
    losses = {}
    for strategy in strategies:
        ddp = {"data_parallel_sharding_strategy": strategy, "check_for_nan_in_grad": True, **VARIANTS[strategy]}
        # optim_grads_params also recomputes activations: it must not change the numbers
        overrides = {"recompute_granularity": "full"} if strategy == "optim_grads_params" else {}
        losses[strategy] = fit(world_size, ddp, STEPS, model_overrides=overrides)
    return losses


@pytest.fixture(scope="module")
def single_process() -> list[float]:
    [losses] = run_distributed(train_each, 1, ["no_shard"])
    return losses["no_shard"]


def test_every_sharding_strategy_matches_single_process(single_process):
    per_rank = run_distributed(train_each, 2, list(VARIANTS))
    assert per_rank[0] == per_rank[1], "the logged loss is the data-parallel mean, the same on every rank"
    assert len(single_process) == STEPS and single_process[-1] < single_process[0] - 0.5, "the model learns"
    for strategy, losses in per_rank[0].items():
        assert losses == pytest.approx(single_process, rel=1e-5, abs=1e-5), strategy

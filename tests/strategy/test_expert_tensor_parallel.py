"""Training a MoE GPT with experts split over ep = 2 and the model over tp = 2 (4 ranks): loss parity with one
process, and a checkpoint saved that way resuming on one process with identical weights and optimizer state.

Two spawns, processes reused for several runs: 4 ranks (experts sharded over tp, expert_tensor_parallel_size=2,
for 10 steps; experts whole on every tp rank, expert_tensor_parallel_size=1, with sequence parallelism and FSDP2
for 10 steps; the chain's first leg, experts sharded with sequence parallelism and FSDP2 -> step 5), then 1 process
(the reference; the chain's second leg -> step 10).
"""

from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import assert_same_checkpoint, fit

MAX_STEPS = 10
MOE = {
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_aux_loss_coeff": 1e-2,
    "moe_z_loss_coeff": 1e-3,
    "moe_shared_expert_intermediate_size": 32,
}
FSDP2 = {"data_parallel_sharding_strategy": "optim_grads_params"}
EP2_TP2 = {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2}


def four_ranks(rank: int, world_size: int, directory: Path) -> dict[str, list[float]]:
    return {
        "ep2_tp2": fit(world_size, {}, MAX_STEPS, model_overrides=MOE, **EP2_TP2),
        "ep2_tp2_whole_experts": fit(
            world_size, FSDP2, MAX_STEPS, model_overrides=MOE, expert_tensor_parallel_size=1, sequence_parallel=True,
            **EP2_TP2,
        ),
        "chain_ep2_tp2": fit(
            world_size, FSDP2, MAX_STEPS, stop_at=5, save_to=directory / "step5", model_overrides=MOE,
            sequence_parallel=True, **EP2_TP2,
        ),
    }  # fmt: skip


def one_process(rank: int, world_size: int, directory: Path) -> dict[str, list[float]]:
    return {
        "reference": fit(world_size, {}, MAX_STEPS, model_overrides=MOE),
        "chain_one_process": fit(
            world_size, {}, MAX_STEPS, ckpt_path=directory / "step5", save_at_start=directory / "loaded5",
            model_overrides=MOE,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[float]]]:
    directory = tmp_path_factory.mktemp("moe_tp")
    losses = run_distributed(four_ranks, 4, directory)[0]
    losses |= run_distributed(one_process, 1, directory)[0]
    return directory, losses


def assert_same_losses(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    assert actual == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_ep2_tp2_with_sharded_experts_matches_one_process(runs):
    _, losses = runs
    assert_same_losses(losses["ep2_tp2"], losses["reference"])
    assert losses["reference"][-1] < losses["reference"][0] - 0.3  # it learns


def test_ep2_tp2_with_whole_experts_and_sequence_parallel_matches_one_process(runs):
    _, losses = runs
    assert_same_losses(losses["ep2_tp2_whole_experts"], losses["reference"])


def test_ep2_tp2_checkpoint_resumes_on_one_process(runs):
    directory, losses = runs
    assert_same_checkpoint(directory / "step5", directory / "loaded5")
    assert_same_losses(losses["chain_ep2_tp2"] + losses["chain_one_process"], losses["reference"])

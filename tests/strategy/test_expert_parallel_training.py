"""Training a MoE GPT with experts split over ranks: loss parity with one process, and checkpoints that resume
under another expert-parallel size with identical weights and optimizer state.

Three spawns, processes reused for several runs: 2 ranks (EP=2 dropless for 20 steps; EP=2 over the two ranks of
CP=2 for 20; capacity-limited EP=2 and EP=1 for 10; the chain's first leg EP=2 -> step 6), 1 process (the
reference; the chain's EP=1 leg -> step 12), 4 ranks (EP=2 x DP=2 on FSDP2 for 20 steps; the chain's EP=4
leg). Capacity drops tokens per micro-batch (as in Megatron-Core), so its reference is EP=1 on the same 2 ranks,
which see the same micro-batches.
"""

from pathlib import Path

import pytest

from nemo_ckpt.parallel import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import assert_same_checkpoint, fit

MAX_STEPS = 20
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3}
CAPACITY = {**MOE, "moe_expert_capacity_factor": 1.0}
FSDP2 = {"data_parallel_sharding_strategy": "optim_grads_params"}
ZERO1 = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim")


def two_ranks(rank: int, world_size: int, directory: Path) -> dict[str, list[float]]:
    return {
        "ep2": fit(world_size, {}, MAX_STEPS, model_overrides=MOE, expert_model_parallel_size=2),
        "ep2_cp2": fit(
            world_size, {}, MAX_STEPS, model_overrides=MOE, expert_model_parallel_size=2, context_parallel_size=2
        ),
        "capacity_ep2": fit(
            world_size, {}, MAX_STEPS, stop_at=10, model_overrides=CAPACITY, expert_model_parallel_size=2
        ),
        "capacity_ep1": fit(world_size, {}, MAX_STEPS, stop_at=10, model_overrides=CAPACITY),
        "chain_ep2": fit(
            world_size, {}, MAX_STEPS, stop_at=6, save_to=directory / "step6", model_overrides=MOE,
            expert_model_parallel_size=2,
        ),
    }  # fmt: skip


def one_process(rank: int, world_size: int, directory: Path) -> dict[str, list[float]]:
    return {
        "reference": fit(world_size, {}, MAX_STEPS, model_overrides=MOE),
        "chain_ep1": fit(
            world_size, {}, MAX_STEPS, ckpt_path=directory / "step6", stop_at=12, save_at_start=directory / "loaded6",
            save_to=directory / "step12", model_overrides=MOE,
        ),
    }  # fmt: skip


def four_ranks(rank: int, world_size: int, directory: Path) -> dict[str, list[float]]:
    return {
        "fsdp_ep2_dp2": fit(world_size, FSDP2, MAX_STEPS, model_overrides=MOE, expert_model_parallel_size=2),
        "chain_ep4": fit(
            world_size, {}, MAX_STEPS, ckpt_path=directory / "step12", stop_at=14,
            save_at_start=directory / "loaded12", model_overrides=MOE, expert_model_parallel_size=4,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[float]]]:
    directory = tmp_path_factory.mktemp("moe")
    losses = run_distributed(two_ranks, 2, directory)[0]
    losses |= run_distributed(one_process, 1, directory)[0]
    losses |= run_distributed(four_ranks, 4, directory)[0]
    return directory, losses


def assert_same_losses(actual: list[float], expected: list[float]) -> None:
    assert len(actual) == len(expected)
    assert actual == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_ep2_matches_one_process(runs):
    _, losses = runs
    assert_same_losses(losses["ep2"], losses["reference"])
    assert losses["reference"][-1] < losses["reference"][0] - 0.5  # it learns


def test_ep2_over_context_parallel_ranks_matches_one_process(runs):
    _, losses = runs
    assert_same_losses(losses["ep2_cp2"], losses["reference"])


def test_ep2_with_capacity_matches_replicated_experts(runs):
    _, losses = runs
    assert_same_losses(losses["capacity_ep2"], losses["capacity_ep1"])
    assert losses["capacity_ep2"] != pytest.approx(losses["ep2"][:10], rel=1e-5, abs=1e-5)  # tokens were dropped


def test_ep2_dp2_on_fsdp2_matches_one_process(runs):
    _, losses = runs
    assert_same_losses(losses["fsdp_ep2_dp2"], losses["reference"])


def test_resume_chain_ep2_ep1_ep4(runs):
    directory, losses = runs
    assert_same_checkpoint(directory / "step6", directory / "loaded6")
    assert_same_checkpoint(directory / "step12", directory / "loaded12")
    chain = losses["chain_ep2"] + losses["chain_ep1"] + losses["chain_ep4"]
    assert_same_losses(chain, losses["reference"][:14])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"expert_model_parallel_size": 0}, "expert_model_parallel_size=0\\): use 1 or more"),
        (
            {"expert_tensor_parallel_size": 2},
            "expert_tensor_parallel_size=2\\) with tensor_model_parallel_size=1: experts are sharded",
        ),
        (
            {"expert_tensor_parallel_size": 2, "tensor_model_parallel_size": 4},
            "expert_tensor_parallel_size=2\\) with tensor_model_parallel_size=4: .* other sizes are not supported",
        ),
        (
            {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
            "expert_tensor_parallel_size=1\\) with pipeline_model_parallel_size > 1 is not supported yet",
        ),
        (
            {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            "pipeline_model_parallel_size > 1 with expert_model_parallel_size > 1 is not supported yet",
        ),
        (
            {"expert_model_parallel_size": 2, "ddp": ZERO1},
            "does not support data_parallel_sharding_strategy='optim' \\(ZeRO-1\\)",
        ),
    ],
)  # fmt: skip
def test_bad_expert_options_fail_at_configuration(options, message):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(**options)


def test_expert_tensor_parallel_size_defaults_to_the_tensor_parallel_size():
    """As in Megatron-Core: experts sharded like the dense layers unless expert_tensor_parallel_size=1."""
    sharded = MegatronStrategy(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    whole = MegatronStrategy(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    assert (sharded.expert_tensor_parallel_size, whole.expert_tensor_parallel_size) == (2, 1)

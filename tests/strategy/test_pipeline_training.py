"""Pipeline parallelism end to end (Lightning, gloo): losses equal one process's, and checkpoints reshard across
pipeline layouts with identical weights and optimizer state.

One run is passed along a chain of layouts, a few steps each: PP=2 1F1B (DDP) -> PP=2 V=2 (interleaved) ->
PP=1 DP=2 FSDP2 -> PP=4 with uneven first/last stages -> PP=2 x DP=2 FSDP2 -> PP=2 x TP=2 -> one process. Its
losses are compared with one uninterrupted process, each checkpoint with what the next layout loaded. A run
killed with SIGKILL under PP=2 resumes bit-identically (the tiny recipe on 2 ranks).
"""

from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from tests.helpers import tiny_run
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import assert_same_checkpoint, fit

MAX_STEPS = 20
MODEL = {"num_layers": 8}
UNEVEN = {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3}  # 1, 2, 2, 3 layers
FSDP2 = {"data_parallel_sharding_strategy": "optim_grads_params"}
# (world size, strategy options, ddp options, model overrides, last step)
CHAIN = [
    (2, {"pipeline_model_parallel_size": 2}, {}, {}, 3),
    (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, {}, {}, 6),
    (2, {}, FSDP2, {}, 9),
    (4, {"pipeline_model_parallel_size": 4}, {}, UNEVEN, 12),
    (4, {"pipeline_model_parallel_size": 2}, FSDP2, {}, 15),
    (4, {"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 2}, {}, {}, 18),
    (1, {}, {}, {}, MAX_STEPS),
]


def train_phase(
    rank: int,
    world_size: int,
    options: dict,
    ddp: dict,
    overrides: dict,
    stop_at: int,
    resume_from: Path | None,
    directory: Path,
) -> list[float]:
    pipelined = options.get("pipeline_model_parallel_size", 1) > 1
    return fit(
        world_size,
        ddp,
        MAX_STEPS,
        ckpt_path=resume_from,
        stop_at=stop_at,
        save_to=directory / f"step{stop_at}",
        save_at_start=directory / f"loaded{resume_from.name[4:]}" if resume_from else None,
        model_overrides={**MODEL, **overrides},
        micro_batch_size=1 if pipelined else None,  # micro-batches for the pipeline: 4 / dp per step
        **options,
    )


def uninterrupted(rank: int, world_size: int) -> list[float]:
    return fit(world_size, {}, MAX_STEPS, model_overrides=MODEL)


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, list[float], list[int]]:
    directory = tmp_path_factory.mktemp("pipeline_chain")
    losses: list[float] = []
    resume_from, start, saved = None, 0, []
    for world_size, options, ddp, overrides, stop_at in CHAIN:
        per_rank = run_distributed(train_phase, world_size, options, ddp, overrides, stop_at, resume_from, directory)
        assert len(per_rank[0]) == stop_at - start, f"{options} {ddp} trains steps {start}..{stop_at}"
        assert all(rank_losses == per_rank[0] for rank_losses in per_rank), "every rank logs the same loss"
        losses += per_rank[0]
        if resume_from is not None:
            saved.append(start)
        resume_from, start = directory / f"step{stop_at}", stop_at
    return directory, losses, saved


def test_losses_match_one_process(chain):
    _, losses, _ = chain
    [reference] = run_distributed(uninterrupted, 1)
    assert len(losses) == MAX_STEPS
    assert losses == pytest.approx(reference, rel=0, abs=1e-5)


@pytest.mark.parametrize("phase", range(1, len(CHAIN)))
def test_resume_loads_identical_weights_and_optimizer_state(chain, phase):
    directory, _, saved = chain
    step = saved[phase - 1]
    assert_same_checkpoint(directory / f"step{step}", directory / f"loaded{step}")


def test_kill_mid_run_under_pipeline_resumes_bit_identically(tmp_path):
    options = {"pipeline_model_parallel_size": 2, "data.global_batch_size": 8}  # 2 micro-batches of 4 per step
    uninterrupted_dir, crashed_dir = tmp_path / "uninterrupted", tmp_path / "crashed"
    assert tiny_run.run_tiny(uninterrupted_dir, max_steps=10, options=options) == 0
    assert tiny_run.run_tiny(crashed_dir, max_steps=10, options=options, kill_at_step=7) != 0
    assert tiny_run.run_tiny(crashed_dir, max_steps=10, options=options) == 0
    resumed_losses, reference_losses = tiny_run.losses(crashed_dir), tiny_run.losses(uninterrupted_dir)
    assert min(resumed_losses) == 5
    assert resumed_losses == {step: reference_losses[step] for step in range(5, 10)}
    expected = dist_checkpointing.load_plain_tensors(tiny_run.step_dir(uninterrupted_dir, 10) / "weights")
    resumed = dist_checkpointing.load_plain_tensors(tiny_run.step_dir(crashed_dir, 10) / "weights")
    assert expected.keys() == resumed.keys()
    assert any(key.startswith("optimizer.state.exp_avg.module.layers.1.") for key in expected)
    for key in expected:
        assert torch.equal(expected[key], resumed[key]), key

"""The tiny recipe on real (generated, tokenized) data on 2 ranks: a run SIGKILLed mid-epoch resumes on
exactly the batches the uninterrupted run saw, without Lightning's "not resumable" warning, to identical weights."""

from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from tests.data.real_tiny_run import batches, real_tiny_recipe
from tests.helpers.distributed import run_recipe
from tests.helpers.tiny_run import step_dir

MAX_STEPS = 6


def run_real_tiny(directory: Path, kill_at_step: int | None = None) -> tuple[int, str]:
    """Run `real_tiny_recipe` on 2 ranks; return the exit code and the ranks' output (of this run)."""
    logs = directory / f"logs-{kill_at_step}"
    logs.mkdir()
    code = run_recipe(real_tiny_recipe, 2, str(directory), MAX_STEPS, kill_at_step, logs=logs)
    return code, "".join(path.read_text() for path in sorted(logs.iterdir()))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("uninterrupted")
    code, output = run_real_tiny(directory)
    assert code == 0, output[-3000:]
    return directory


def test_killed_run_resumes_on_the_same_batches_with_identical_weights(uninterrupted, tmp_path):
    assert run_real_tiny(tmp_path, kill_at_step=4)[0] != 0
    code, output = run_real_tiny(tmp_path)
    assert code == 0, output[-3000:]
    assert "Restoring states from the checkpoint path" in output, "the output is the resumed run's"
    assert "not resumable" not in output

    for rank in (0, 1):
        expected, seen = batches(uninterrupted, rank), batches(tmp_path, rank)
        assert sorted(expected) == sorted(seen) == list(range(MAX_STEPS))
        for step in range(MAX_STEPS):
            assert seen[step] == expected[step], f"rank {rank} step {step}"
    first_steps = [batches(uninterrupted, rank)[0] for rank in (0, 1)]
    assert first_steps[0] != first_steps[1], "the data-parallel ranks read different samples"

    expected_weights = dist_checkpointing.load_plain_tensors(step_dir(uninterrupted, MAX_STEPS) / "weights")
    resumed_weights = dist_checkpointing.load_plain_tensors(step_dir(tmp_path, MAX_STEPS) / "weights")
    assert expected_weights.keys() == resumed_weights.keys()
    for key in expected_weights:
        assert torch.equal(expected_weights[key], resumed_weights[key]), key

"""The tiny recipe on real (generated, tokenized) data on 2 torchrun ranks: a run SIGKILLed mid-epoch resumes on
exactly the batches the uninterrupted run saw, without Lightning's "not resumable" warning, to identical weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from tests.data.real_tiny_run import batches
from tests.helpers.tiny_run import REPO, step_dir

MAX_STEPS = 6


def torchrun_real_tiny(directory: Path, kill_at_step: int | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tests.data.real_tiny_run"]
    command += [str(directory), str(MAX_STEPS)] + ([str(kill_at_step)] if kill_at_step is not None else [])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("uninterrupted")
    result = torchrun_real_tiny(directory)
    assert result.returncode == 0, result.stderr[-3000:]
    return directory


def test_killed_run_resumes_on_the_same_batches_with_identical_weights(uninterrupted, tmp_path):
    assert torchrun_real_tiny(tmp_path, kill_at_step=4).returncode != 0
    resumed = torchrun_real_tiny(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "not resumable" not in resumed.stdout + resumed.stderr

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

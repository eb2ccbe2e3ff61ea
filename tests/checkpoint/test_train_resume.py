"""The tiny recipe on 2 ranks: checkpoints on disk, and a SIGKILLed run resumes bit-identically."""

import json
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from tests.helpers.tiny_run import checkpoints, losses, run_tiny, step_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("uninterrupted")
    assert run_tiny(directory, max_steps=10) == 0
    return directory


def test_run_leaves_complete_checkpoints_with_last_link(uninterrupted):
    manifest = json.loads((checkpoints(uninterrupted) / "checkpoints.json").read_text())
    assert [record["step"] for record in manifest["checkpoints"]] == [5, 10]
    newest = step_dir(uninterrupted, 10)
    assert manifest["last"] == newest.name
    last = checkpoints(uninterrupted) / f"{newest.name}-last"
    assert last.is_symlink() and last.resolve() == newest.resolve()
    for step in (5, 10):
        weights = step_dir(uninterrupted, step) / "weights"
        assert json.loads((weights / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        assert sorted(p.name for p in weights.glob("*.distcp")) == [  # 2 writers per rank; replicas split over ranks
            "__0_0.distcp",
            "__0_1.distcp",
            "__1_0.distcp",
            "__1_1.distcp",
        ]
        common = dist_checkpointing.load_common_state_dict(weights)
        assert common["global_step"] == step
        assert (step_dir(uninterrupted, step) / "context" / "model.json").is_file()
    assert not list(checkpoints(uninterrupted).glob(".tmp-*"))


def test_killed_run_resumes_at_saved_step_with_identical_weights(uninterrupted, tmp_path):
    assert run_tiny(tmp_path, max_steps=10, kill_at_step=7) != 0
    manifest = json.loads((checkpoints(tmp_path) / "checkpoints.json").read_text())
    assert [record["step"] for record in manifest["checkpoints"]] == [5]

    assert run_tiny(tmp_path, max_steps=10) == 0
    resumed_losses = losses(tmp_path)
    assert min(resumed_losses) == 5, "the resumed run starts at the saved step, not before it"
    reference_losses = losses(uninterrupted)
    assert resumed_losses == {step: reference_losses[step] for step in range(5, 10)}

    expected = dist_checkpointing.load_plain_tensors(step_dir(uninterrupted, 10) / "weights")
    resumed = dist_checkpointing.load_plain_tensors(step_dir(tmp_path, 10) / "weights")
    assert expected.keys() == resumed.keys()
    assert any(key.startswith("optimizer.state.exp_avg.") for key in expected)
    for key in expected:
        assert torch.equal(expected[key], resumed[key]), key

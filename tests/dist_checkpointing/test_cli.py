"""``python -m nemo_ckpt inspect`` and ``consolidate`` on a checkpoint saved by 2 ranks; ``consolidate
--weights-only`` and the mode of its file; ``verify`` on paths that are not checkpoints."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import ShardedObject, ShardedTensor
from nemo_ckpt.dist_checkpointing.cli import main
from tests.helpers.distributed import run_distributed


def _save(rank: int, ws: int, ckpt: str) -> None:
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets(
                "decoder.w", torch.arange(8, dtype=torch.bfloat16).view(2, 4) + 8 * rank, (0, rank, ws)
            ),
            "o": ShardedObject("rng", rank, (ws,), (rank,)),
            "iteration": 5,
        },
        ckpt,
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nemo_ckpt", *args], capture_output=True, text=True, timeout=120)


def test_inspect_and_consolidate(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_distributed(_save, 2, str(ckpt))

    out = _cli("inspect", str(ckpt), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["backend"]["sharded_backend"] == "torch_dist"
    assert info["tensors"]["decoder.w"] == {"shape": [4, 4], "dtype": "bfloat16", "bytes": 32, "chunks": 2}
    assert set(info["objects"]) == {"rng/shard_0_2", "rng/shard_1_2", "common_state/shard_0_1"}
    assert info["common_keys"] == ["iteration"] and len(info["files"]) == 4  # 2 ranks x 2 writers
    expected = torch.arange(16, dtype=torch.bfloat16).view(4, 4)
    assert _cli("consolidate", str(ckpt), str(tmp_path / "model.pt")).returncode == 0
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["decoder.w"], expected)

    # the same entry point in this process (faster than more subprocesses)
    assert main(["inspect", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "decoder.w" in text and "(4, 4)" in text and "bfloat16" in text and "torch_dist v1" in text
    assert main(["consolidate", str(ckpt), str(tmp_path / "model.safetensors")]) == 0
    assert torch.equal(load_file(tmp_path / "model.safetensors")["decoder.w"], expected)
    assert main(["inspect", str(tmp_path)]) == 1
    assert "is not a distributed checkpoint" in capsys.readouterr().err


def test_verify_names_a_missing_path_a_file_and_a_directory_that_is_no_checkpoint(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {
        "missing": "does not exist",
        "file": "is not a checkpoint directory: it is a file",
        "empty": "is not a distributed checkpoint: it holds no metadata.json or .metadata",
    }
    for name, message in cases.items():
        assert main(["verify", str(tmp_path / name)]) == 1
        assert f"error: {tmp_path / name} {message}" in capsys.readouterr().err


def _training_checkpoint(checkpoint) -> None:
    """A training checkpoint's `weights/`: model tensors and the optimizer state of one of them."""
    weight = torch.arange(6.0).view(2, 3)
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets("module.w", weight, replica_id=0),
            "m": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.module.w", weight * 2, replica_id=0),
        },
        checkpoint / "weights",
    )


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_consolidate_weights_only_and_the_mode_of_the_file(tmp_path, umask):
    (tmp_path / "ckpt" / "weights").mkdir(parents=True)
    _training_checkpoint(tmp_path / "ckpt")
    previous = os.umask(umask)
    try:
        for name in ("all.safetensors", "all.pt", "weights.safetensors", "weights.pt"):
            weights_only = ["--weights-only"] if name.startswith("weights") else []
            assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / name), *weights_only]) == 0
    finally:
        os.umask(previous)
    for name in ("all.safetensors", "all.pt", "weights.safetensors", "weights.pt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name  # as open() creates files
    loaded = {"safetensors": load_file, "pt": lambda path: torch.load(path, weights_only=True)}
    for name in ("all", "weights"):
        for suffix, load in loaded.items():
            keys = set(load(tmp_path / f"{name}.{suffix}"))
            expected = {"module.w"} | ({"optimizer.state.exp_avg.module.w"} if name == "all" else set())
            assert keys == expected, (name, suffix)

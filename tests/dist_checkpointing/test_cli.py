"""``python -m nemo_ckpt inspect`` and ``consolidate`` on a checkpoint saved by 2 ranks."""

import json
import subprocess
import sys

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

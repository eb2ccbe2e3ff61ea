"""Core save/load round trip across world sizes (the basic-sharding example of the spec)."""

import json
import os

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import LocalNonpersistentObject, ShardedObject, ShardedTensor
from tests.helpers.distributed import run_distributed


def _save_body(rank: int, world_size: int, ckpt_dir: str) -> None:
    n = 128 // world_size
    local = torch.arange(n * rank, n * (rank + 1), dtype=torch.float32)
    # 2-D tensor sharded on axis 1, replicated (main replica on rank 0) bias, object per rank
    w = (
        torch.arange(8 * 4 * world_size, dtype=torch.float32)
        .view(8, 4 * world_size)[:, 4 * rank : 4 * (rank + 1)]
        .clone()
    )
    state = {
        "weight": ShardedTensor.from_rank_offsets("weight", local, (0, rank, world_size)),
        "model": {
            "w2d": ShardedTensor.from_rank_offsets("layer.w", w, (1, rank, world_size)),
            "bias": ShardedTensor.from_rank_offsets("layer.b", torch.full((3,), 7.0), replica_id=rank),
        },
        "rng": ShardedObject("rng", {"rank": rank, "seed": 100 + rank}, (world_size,), (rank,)),
        "iteration": 42,
        "nested": {"names": ["a", "b"], "lr": 0.5},
        "local": LocalNonpersistentObject("not saved"),
    }
    dc.save(state, ckpt_dir, content_metadata={"format": "test", "v": 2})


def _load_body(rank: int, world_size: int, ckpt_dir: str, saved_world_size: int) -> dict:
    n = 128 // world_size
    w_cols = 4 * saved_world_size // world_size
    state = {
        "renamed": ShardedTensor.from_rank_offsets("weight", torch.empty(n), (0, rank, world_size)),
        "model": {
            "w2d": ShardedTensor.from_rank_offsets("layer.w", torch.empty(8, w_cols), (1, rank, world_size)),
            "bias": ShardedTensor.from_rank_offsets("layer.b", torch.zeros(3), replica_id=rank),
        },
        "local": LocalNonpersistentObject(f"local-{rank}"),
        # every saved object read once as main replica; extra ranks read a non-main replica
        "rng": [
            ShardedObject("rng", None, (saved_world_size,), (i,)) for i in range(rank, saved_world_size, world_size)
        ]
        + [ShardedObject("rng", None, (saved_world_size,), (rank % saved_world_size,), replica_id=1)]
        * (rank >= saved_world_size),
    }
    loaded = dc.load(state, ckpt_dir)
    full_w = torch.arange(8 * 4 * saved_world_size, dtype=torch.float32).view(8, -1)
    assert torch.equal(loaded["renamed"], torch.arange(n * rank, n * (rank + 1), dtype=torch.float32))
    assert torch.equal(loaded["model"]["w2d"], full_w[:, w_cols * rank : w_cols * (rank + 1)])
    assert torch.equal(loaded["model"]["bias"], torch.full((3,), 7.0))
    assert "weight" not in loaded
    assert loaded["local"] == f"local-{rank}"
    assert loaded["iteration"] == 42 and loaded["nested"] == {"names": ["a", "b"], "lr": 0.5}
    expected_objs = [i for i in range(rank, saved_world_size, world_size)] + [rank % saved_world_size] * (
        rank >= saved_world_size
    )
    assert loaded["rng"] == [{"rank": i, "seed": 100 + i} for i in expected_objs]
    return {"keys": sorted(loaded)}


@pytest.mark.parametrize("save_ws,load_ws", [(2, 2), (2, 4), (4, 1)])
def test_save_load_across_world_sizes(tmp_path, save_ws, load_ws):
    ckpt = str(tmp_path)
    run_distributed(_save_body, save_ws, ckpt)
    with open(os.path.join(ckpt, "metadata.json")) as f:
        assert json.load(f) == {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
    assert os.path.isfile(os.path.join(ckpt, "common.pt"))
    assert os.path.isfile(os.path.join(ckpt, ".metadata"))
    results = run_distributed(_load_body, load_ws, ckpt, save_ws)
    assert all("local" in r["keys"] for r in results)
    # metadata-only entry points, in this process
    common = dc.load_common_state_dict(ckpt)
    assert common["iteration"] == 42 and "local" not in common
    assert dc.load_content_metadata(ckpt) == {"format": "test", "v": 2}
    meta = dc.load_tensors_metadata(ckpt)
    assert set(meta) == {"weight", "layer.w", "layer.b"}
    assert meta["layer.w"].global_shape == (8, 4 * save_ws) and meta["layer.w"].dtype == torch.float32
    plain = dc.load_plain_tensors(ckpt)
    assert torch.equal(plain["weight"], torch.arange(128, dtype=torch.float32))

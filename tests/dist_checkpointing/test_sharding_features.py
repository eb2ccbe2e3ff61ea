"""Uneven sharding, prepended axes, flattened ranges (distributed optimizer) with DP/TP
resharding, allow_shape_mismatch padding/stripping, ShardedTensorFactory, dtypes, scalars.

Each case is saved at one world size and loaded at another."""

import math

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import ShardedTensor, ShardedTensorFactory
from tests.helpers.distributed import run_distributed

UNEVEN = torch.arange(20, dtype=torch.float32)
LAYERS = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)
PARAM = torch.arange(4 * 6, dtype=torch.float32).view(4, 6) * 10  # distributed-optimizer param
FUSED = torch.arange(8, dtype=torch.float32).view(4, 2)


def _bounds(n: int, parts: int) -> list[int]:
    """Uneven split points of range(n) into ``parts``, e.g. 20/4 -> [0, 1, 5, 11, 20]."""
    return [round(n * k * k / (parts * parts)) for k in range(parts + 1)]


def _uneven(rank: int, ws: int, template: bool) -> ShardedTensor:
    b = _bounds(20, ws)
    data = torch.empty(b[rank + 1] - b[rank]) if template else UNEVEN[b[rank] : b[rank + 1]].clone()
    return ShardedTensor("uneven", data, torch.float32, tuple(data.shape), (20,), (b[rank],), None)


def _layers(rank: int, ws: int, template: bool) -> list[ShardedTensor]:
    """Layer i (a (6,) tensor) lives on rank i % ws, stacked on a prepended axis."""
    return [
        ShardedTensor.from_rank_offsets(
            "layers.w", torch.empty(6) if template else LAYERS[i].clone(), (0, i, 4), prepend_axis_num=1
        )
        for i in range(rank, 4, ws)
    ]


def _tp_dp(ws: int) -> tuple[int, int]:
    tp = 2 if ws % 2 == 0 else 1
    return tp, ws // tp


def _dist_opt(rank: int, ws: int, template: bool) -> ShardedTensor:
    """PARAM is TP-sharded on axis 1, then each TP shard is flattened and split over DP."""
    tp, dp = _tp_dp(ws)
    tp_rank, dp_rank = divmod(rank, dp)
    cols = 6 // tp
    local = PARAM[:, tp_rank * cols : (tp_rank + 1) * cols]
    b = _bounds(local.numel(), dp)
    rng = slice(b[dp_rank], b[dp_rank + 1])
    data = torch.empty(rng.stop - rng.start) if template else local.flatten()[rng].clone()
    return ShardedTensor.from_rank_offsets_flat(
        "optimizer.param", data, tuple(local.shape), (1, tp_rank, tp), flattened_range=rng
    )


def _embedding(rank: int, ws: int, rows: int, template: bool) -> ShardedTensor:
    """Embedding with ``rows`` rows (vocab 12, possibly padded) split on axis 0 over ws ranks."""
    per = rows // ws
    data = torch.full((per, 2), -1.0) if template else _vocab(rows)[rank * per : (rank + 1) * per].clone()
    return ShardedTensor.from_rank_offsets("embedding", data, (0, rank, ws), allow_shape_mismatch=True)


def _vocab(rows: int) -> torch.Tensor:
    v = torch.zeros(rows, 2)
    n = min(rows, 12)
    v[:n] = torch.arange(24, dtype=torch.float32).view(12, 2)[:n]
    return v


def _fused(rank: int, data: torch.Tensor) -> ShardedTensorFactory:
    """Stored as two keys (top and bottom halves); merged back into one tensor on load."""

    def build(key, t, replica_id, flattened_range):
        return {
            "top": ShardedTensor.from_rank_offsets(f"{key}.top", t[:2], replica_id=replica_id),
            "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", t[2:], replica_id=replica_id),
        }

    def merge(sub):
        return torch.cat([sub["top"], sub["bottom"]])

    return ShardedTensorFactory("fused", data, build, merge, replica_id=rank)


def _state(rank: int, ws: int, template: bool, emb_rows: int) -> dict:
    return {
        "uneven": _uneven(rank, ws, template),
        "layers": _layers(rank, ws, template),
        "dist_opt": _dist_opt(rank, ws, template),
        "emb": _embedding(rank, ws, emb_rows, template),
        "fused": _fused(rank, torch.zeros(4, 2) if template else FUSED.clone()),
        "bf16": ShardedTensor.from_rank_offsets(
            "bf16",
            torch.zeros(3, dtype=torch.bfloat16) if template else torch.tensor([1.5, 2.5, 3.5], dtype=torch.bfloat16),
            replica_id=(0, rank),
        ),
        "scalar": ShardedTensor.from_rank_offsets(
            "scalar", torch.tensor(0) if template else torch.tensor(7), replica_id=rank
        ),
    }


def _save(rank: int, ws: int, ckpt: str) -> None:
    dc.save(_state(rank, ws, template=False, emb_rows=12), ckpt)


def _load(rank: int, ws: int, ckpt: str, emb_rows: int) -> None:
    loaded = dc.load(_state(rank, ws, template=True, emb_rows=emb_rows), ckpt)
    b = _bounds(20, ws)
    assert torch.equal(loaded["uneven"], UNEVEN[b[rank] : b[rank + 1]])
    assert [t.tolist() for t in loaded["layers"]] == [LAYERS[i].tolist() for i in range(rank, 4, ws)]
    assert torch.equal(loaded["dist_opt"], _dist_opt(rank, ws, template=False).data)
    per = emb_rows // ws
    assert torch.equal(loaded["emb"], _vocab(emb_rows)[rank * per : (rank + 1) * per])  # zero padding or stripped
    assert torch.equal(loaded["fused"], FUSED)
    assert loaded["bf16"].dtype == torch.bfloat16 and loaded["bf16"].tolist() == [1.5, 2.5, 3.5]
    assert loaded["scalar"].item() == 7


@pytest.mark.parametrize("save_ws,load_ws,emb_rows", [(1, 2, 16), (4, 2, 8), (2, 4, 16)])
def test_reshard_features(tmp_path, save_ws, load_ws, emb_rows):
    run_distributed(_save, save_ws, str(tmp_path))
    meta = dc.load_tensors_metadata(tmp_path)
    assert meta["optimizer.param"].global_shape == (4, 6)  # flat shards stored with the real global shape
    assert meta["layers.w"].global_shape == (4, 6)
    assert meta["uneven"].global_shape == (20,)
    assert set(meta) >= {"fused.top", "fused.bottom"} and "fused" not in meta
    plain = dc.load_plain_tensors(tmp_path)
    assert torch.equal(plain["optimizer.param"], PARAM)
    assert torch.equal(plain["embedding"], _vocab(12))
    run_distributed(_load, load_ws, str(tmp_path), emb_rows)


def test_flat_range_boxes_cover_range_exactly():
    from nemo_ckpt.dist_checkpointing.mapping import flat_range_boxes

    shape = (3, 4, 5)
    for start, stop in [(0, 60), (7, 8), (3, 47), (20, 40), (19, 41), (0, 1), (59, 60)]:
        boxes = flat_range_boxes(shape, start, stop)
        flat = []
        for off, size in boxes:
            idx = torch.arange(60).view(shape)[tuple(slice(o, o + s) for o, s in zip(off, size))]
            flat += idx.flatten().tolist()
        assert flat == list(range(start, stop))
        assert len(boxes) <= 2 * len(shape) - 1


def test_sharded_tensor_constructors_and_object_key():
    t = torch.zeros(2, 3)
    st = ShardedTensor.from_rank_offsets("k", t, (0, 1, 4), (2, 0, 2), prepend_axis_num=1)
    # axes count global dims: axis 0 is the prepended one
    assert st.global_shape == (4, 2, 6) and st.global_offset == (1, 0, 0) and st.axis_fragmentations == (4, 1, 2)
    assert st.local_chunk_offset_in_global() == (1, 0, 0) and st.max_allowed_chunks() == (1, 2, 3)
    assert st.global_slice() == (1, slice(0, 2), slice(0, 3))
    flat = ShardedTensor.from_rank_offsets_flat("k", torch.zeros(4), (2, 3), (0, 1, 2), flattened_range=slice(1, 5))
    assert flat.local_shape == (2, 3) and flat.global_shape == (4, 3) and flat.flattened_range == slice(1, 5)
    with pytest.raises(dc.CheckpointingException, match="Data shape"):
        ShardedTensor("k", t, torch.float32, (3, 2), (3, 2), (0, 0), None)
    with pytest.raises(dc.CheckpointingException, match="Invalid rank offsets"):
        ShardedTensor.from_rank_offsets("k", t, (0, 4, 4))
    obj = dc.ShardedObject("rng", 1, (2, 4), (1, 3))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    back = dc.ShardedObject.empty_from_unique_key(obj.unique_key)
    assert (back.key, back.global_offset, back.global_shape, back.data) == ("rng", (1, 3), (2, 4), None)
    assert math.prod(st.global_shape) == 48

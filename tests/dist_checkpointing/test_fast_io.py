"""The torch_dist fast reader: raw reads into the destination, DCP's reader for anything else, and
checkpoints that plain DCP reads (and that we read from plain DCP)."""

import io
import os
import pickle
import threading
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.strategies import fast_reader
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from tests.helpers.distributed import run_distributed

FULL = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
HALF = torch.arange(4 * 10, dtype=torch.bfloat16).view(4, 10)


def _save(directory: Path, thread_count: int = 2) -> None:
    """FULL as 4 row blocks, HALF whole, a flat shard of FULL and an object, from one process."""
    state = {
        "blocks": [
            dc.ShardedTensor.from_rank_offsets("w", FULL[2 * i : 2 * i + 2].clone(), (0, i, 4)) for i in range(4)
        ],
        "half": dc.ShardedTensor.from_rank_offsets("half", HALF.clone()),
        "flat": dc.ShardedTensor.from_rank_offsets_flat(
            "flat", FULL.flatten()[5:48].clone(), (8, 6), flattened_range=slice(5, 48)
        ),
        "flat_head": dc.ShardedTensor.from_rank_offsets_flat(
            "flat", FULL.flatten()[:5].clone(), (8, 6), flattened_range=slice(0, 5), replica_id=0
        ),
        "obj": dc.ShardedObject("obj", {"a": 1}, (1,), (0,)),
    }
    dc.save(state, directory, TorchDistSaveShardedStrategy(thread_count=thread_count))


@pytest.fixture
def no_dcp_reader(monkeypatch):
    """Fail if anything falls back to DCP's FileSystemReader.read_data."""

    def refuse(*args, **kwargs):
        raise AssertionError("fell back to DCP's reader")

    monkeypatch.setattr(FileSystemReader, "read_data", refuse)


@pytest.mark.parametrize("staging_bytes", [fast_reader.STAGING_BYTES, 0], ids=["default", "one staged item at a time"])
def test_fast_path_reads_reshards_and_strided_targets(tmp_path, no_dcp_reader, monkeypatch, staging_bytes):
    monkeypatch.setattr(fast_reader, "STAGING_BYTES", staging_bytes)
    _save(tmp_path)
    # 2 row blocks of 4 rows (each spans 2 stored chunks), into a transposed (non-contiguous) buffer
    column_major = torch.zeros(6, 4).t()
    rows = [
        dc.ShardedTensor.from_rank_offsets("w", column_major, (0, 0, 2)),
        dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 2)),
    ]
    # columns 2:5 of every row: a box that is not contiguous in any stored chunk
    cols = dc.ShardedTensor("w", torch.zeros(8, 3), torch.float32, (8, 3), (8, 6), (0, 2), None)
    request = {
        "rows": rows,
        "half": dc.ShardedTensor.from_rank_offsets("half", torch.zeros(4, 10, dtype=torch.bfloat16)),
        "flat": dc.ShardedTensor.from_rank_offsets_flat("flat", torch.zeros(20), (8, 6), flattened_range=slice(13, 33)),
        "obj": dc.ShardedObject("obj", None, (1,), (0,)),
    }
    loaded = dc.load(request, tmp_path, validate_access_integrity=False)
    assert torch.equal(loaded["rows"][0], FULL[:4]) and loaded["rows"][0].data_ptr() == column_major.data_ptr()
    assert torch.equal(loaded["rows"][1], FULL[4:])
    assert torch.equal(loaded["half"], HALF)
    assert torch.equal(loaded["flat"], FULL.flatten()[13:33])
    assert loaded["obj"] == {"a": 1}
    strategy = TorchDistLoadShardedStrategy(thread_count=3)
    assert torch.equal(strategy.load({"cols": cols}, tmp_path)["cols"], FULL[:, 2:5])
    assert torch.equal(dc.load_plain_tensors(tmp_path)["flat"], FULL)


def test_large_tensors_are_read_by_sequential_streams(tmp_path, no_dcp_reader, monkeypatch):
    _save(tmp_path, thread_count=1)
    monkeypatch.setattr(fast_reader, "READ_CHUNK", 16)
    monkeypatch.setattr(fast_reader, "STREAM_RUN", 32)
    reads: list[tuple[str, int, int, int]] = []
    pread_all = fast_reader._pread_all

    def record(fd: int, view: memoryview, offset: int) -> None:
        reads.append((threading.current_thread().name, fd, offset, view.nbytes))
        pread_all(fd, view, offset)

    monkeypatch.setattr(fast_reader, "_pread_all", record)
    request = {
        "w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6)),
        "half": dc.ShardedTensor.from_rank_offsets("half", torch.zeros(4, 10, dtype=torch.bfloat16)),
    }
    loaded = dc.load(request, tmp_path, validate_access_integrity=False)
    assert torch.equal(loaded["w"], FULL) and torch.equal(loaded["half"], HALF)
    # 4 stored blocks of 48 bytes and 80 bytes of HALF, in reads within 16-byte pieces of the file
    assert sum(n for *_, n in reads) == 4 * 48 + 80
    assert all(offset // 16 == (offset + n - 1) // 16 for _, _, offset, n in reads)
    # each 32-byte run of the file is read by stream (run % 4), a thread with a descriptor of its own
    assert all(name.startswith(f"ckpt-range-reader-{offset // 32 % 4}_") for name, _, offset, _ in reads)
    descriptors = {name: {fd for thread, fd, *_ in reads if thread == name} for name, *_ in reads}
    assert len(descriptors) == 4 and all(len(fds) == 1 for fds in descriptors.values())
    assert len({fd for fds in descriptors.values() for fd in fds}) == 4


def test_stored_layout_is_read_from_data_pkl(tmp_path, no_dcp_reader):
    """Plain DCP saves a transposed tensor (and a view with a storage offset) as they are."""
    base = torch.arange(5 * 7, dtype=torch.float64)
    state = {"t": torch.arange(6 * 4, dtype=torch.float32).view(6, 4).t(), "view": base[1:].view(2, 17)[:, 3:9]}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    metadata = pickle.load(open(tmp_path / ".metadata", "rb"))
    info = metadata.storage_data[MetadataIndex("t", (0, 0))]
    fd = os.open(tmp_path / info.relative_path, os.O_RDONLY)
    try:
        raw = fast_reader.locate_tensor(fd, info.offset, info.length)
    finally:
        os.close(fd)
    assert (raw.dtype, raw.size, raw.stride, raw.storage_offset) == (torch.float32, (4, 6), (1, 4), 0)
    request = {
        "t": dc.ShardedTensor.from_rank_offsets("t", torch.zeros(4, 6)),
        "view": dc.ShardedTensor.from_rank_offsets("view", torch.zeros(2, 6, dtype=torch.float64)),
    }
    loaded = TorchDistLoadShardedStrategy().load(request, tmp_path)
    assert torch.equal(loaded["t"], state["t"]) and torch.equal(loaded["view"], state["view"])


def _item(directory: Path, **save_kwargs) -> Path:
    path = directory / "item.pt"
    with open(path, "wb") as f:
        f.write(b"x" * 10)  # items start anywhere in a file
        torch.save(torch.arange(6.0), f, **save_kwargs)
    return path


def _locate(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return fast_reader.locate_tensor(fd, 10, os.path.getsize(path) - 10)
    finally:
        os.close(fd)


def test_locate_tensor_declines_what_it_does_not_know(tmp_path):
    assert _locate(_item(tmp_path)).size == (6,)
    assert _locate(_item(tmp_path, _use_new_zipfile_serialization=False)) is None  # legacy format
    for name, rewrite in [
        ("big endian", lambda n, d: b"big" if n.endswith("byteorder") else d),
        ("a pickle of something else", lambda n, d: pickle.dumps([1]) if n.endswith("data.pkl") else d),
    ]:
        original = zipfile.ZipFile(io.BytesIO(_item(tmp_path).read_bytes()[10:]))
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as out:
            for info in original.infolist():
                out.writestr(info.filename, rewrite(info.filename, original.read(info)))
        (tmp_path / "item.pt").write_bytes(b"x" * 10 + buffer.getvalue())
        assert _locate(tmp_path / "item.pt") is None, name
    compressed = io.BytesIO()
    with zipfile.ZipFile(compressed, "w", zipfile.ZIP_DEFLATED) as out:
        for info in original.infolist():
            out.writestr(info.filename, original.read(info))
    (tmp_path / "item.pt").write_bytes(b"x" * 10 + compressed.getvalue())
    assert _locate(tmp_path / "item.pt") is None


def test_items_with_transforms_are_left_to_dcp(tmp_path):
    info = _StorageInfo("item.pt", 10, os.path.getsize(_item(tmp_path)) - 10, transform_descriptors=["zstd/1"])
    index = MetadataIndex("t", (0,))
    req = ReadItem(LoadItemType.TENSOR, index, torch.Size([0]), index, torch.Size([0]), torch.Size([6]))
    assert fast_reader.read_items(tmp_path, {index: info}, [req], planner=None, thread_count=2) == [req]


def test_fallback_to_dcp_reader_gives_the_same_values(tmp_path, monkeypatch):
    _save(tmp_path)
    monkeypatch.setattr(fast_reader, "locate_tensor", lambda *args: None)
    plain = dc.load_plain_tensors(tmp_path)
    assert torch.equal(plain["w"], FULL) and torch.equal(plain["flat"], FULL) and torch.equal(plain["half"], HALF)


def test_plain_dcp_load_reads_our_checkpoint(tmp_path):
    """Plain DCP reads every tensor; a flattened range of an N-D tensor (a distributed optimizer's state) is stored
    as Megatron-Core stores it, reformulated (one row per local shard, here the whole [8, 6] in one row of 48) with
    its real shape in the metadata's `mcore_data`, which megatron-core's reader needs (and ours reads)."""
    _save(tmp_path, thread_count=3)
    state = {"w": torch.zeros(8, 6), "half": torch.zeros(4, 10, dtype=torch.bfloat16), "flat": torch.zeros(1, 1, 48)}
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(state["w"], FULL) and torch.equal(state["half"], HALF)
    assert torch.equal(state["flat"], FULL.view(1, 1, 48))
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    assert metadata.mcore_data == {"flat": {"nd_reformulated_orig_global_shape": (8, 6)}}


def _save_2_ranks(rank: int, world_size: int, directory: str) -> None:
    rows = 8 // world_size
    dc.save(
        {
            "w": dc.ShardedTensor.from_rank_offsets(
                "w", FULL[rank * rows : (rank + 1) * rows].clone(), (0, rank, world_size)
            )
        },
        Path(directory),
        TorchDistSaveShardedStrategy(thread_count=2),
    )


def test_two_rank_checkpoint_loads_on_one_rank_fast(tmp_path, no_dcp_reader):
    run_distributed(_save_2_ranks, 2, str(tmp_path))
    loaded = dc.load({"w": dc.ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}, tmp_path)
    assert torch.equal(loaded["w"], FULL)


def test_save_without_crc32_reads_everywhere(tmp_path):
    """crc32=False: zero CRC-32s in the tensors' zip entries; torch.load (DCP) and we read them alike."""
    state = {
        "w": dc.ShardedTensor.from_rank_offsets("w", FULL.clone()),
        "obj": dc.ShardedObject("obj", {"a": 1}, (1,), (0,)),
    }
    dc.save(state, tmp_path, TorchDistSaveShardedStrategy(thread_count=2, crc32=False))
    metadata = pickle.load(open(tmp_path / ".metadata", "rb"))
    info = metadata.storage_data[MetadataIndex("w", (0, 0))]
    with open(tmp_path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)
    assert {entry.CRC for entry in zipfile.ZipFile(io.BytesIO(item)).infolist()} == {0}
    assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), FULL)
    plain = {"w": torch.zeros(8, 6)}
    dcp.load(plain, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(plain["w"], FULL)
    loaded = dc.load(
        {
            "w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6)),
            "obj": dc.ShardedObject("obj", None, (1,), (0,)),
        },
        tmp_path,
    )
    assert torch.equal(loaded["w"], FULL) and loaded["obj"] == {"a": 1}

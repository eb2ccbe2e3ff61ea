"""How a save's bytes reach the disk (`ItemFileStream`): large tensors with O_DIRECT, wherever their memory starts
(zero padding puts them at the same offset within a file block as within a page; their partial first and last
blocks go through the page cache); everything else through the page cache with early writeback; the page cache
alone where the file system refuses O_DIRECT. Every variant loads the same values, through our reader and DCP's,
and its checksums cover every byte of the file."""

import errno
import json
import math
import mmap
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.integrity import CHECKSUMS_FNAME, verify_checkpoint
from nemo_ckpt.dist_checkpointing.strategies import filesystem_async
from nemo_ckpt.dist_checkpointing.strategies.direct_io import DIRECT_ALIGNMENT, DIRECT_MIN_BYTES
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this OS")

# two tensors above the O_DIRECT threshold (one whose length is not whole blocks), two small ones between them
SHAPES = {"big": (DIRECT_MIN_BYTES // 4 + 1024,), "odd": (DIRECT_MIN_BYTES // 4 + 3, 1), "small": (5, 3), "b": (7,)}


def values() -> dict[str, torch.Tensor]:
    return {
        k: torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, (k, shape) in enumerate(SHAPES.items())
    }


def sharded(tensors: dict[str, torch.Tensor]) -> dict:
    return {k: dc.ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}


@pytest.fixture
def pwrites(monkeypatch) -> list[tuple[int, int]]:
    """(offset, length) of every O_DIRECT write."""
    calls: list[tuple[int, int]] = []
    pwrite = os.pwrite

    def record(fd: int, data, offset: int) -> int:
        calls.append((offset, memoryview(data).nbytes))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", record)
    return calls


def save(directory: Path, asynchronous: bool) -> None:
    strategy = TorchDistSaveShardedStrategy(thread_count=1, crc32=False)
    request = dc.save(sharded(values()), directory, strategy, async_sharded_save=asynchronous)
    if asynchronous:
        request.execute_sync()


def assert_loads_and_verifies(directory: Path) -> None:
    expected = values()
    loaded = dc.load(sharded({k: torch.zeros(shape) for k, shape in SHAPES.items()}), directory)
    assert all(torch.equal(loaded[k], expected[k]) for k in SHAPES)
    plain = {k: torch.zeros(shape) for k, shape in SHAPES.items()}
    dcp.load(plain, checkpoint_id=directory, no_dist=True)
    assert all(torch.equal(plain[k], expected[k]) for k in SHAPES)
    assert verify_checkpoint(directory) == []
    ranges = json.loads((directory / CHECKSUMS_FNAME).read_text())["files"]["__0_0.distcp"]
    assert [offset for offset, _, _ in ranges] == [0] + [o + n for o, n, _ in ranges[:-1]]  # they tile the file
    assert sum(n for _, n, _ in ranges) == (directory / "__0_0.distcp").stat().st_size


def supports_direct_writes(directory: Path) -> bool:
    """Whether `directory`'s file system takes an O_DIRECT write of one aligned block (tmpfs before Linux 6.6,
    some overlay and network file systems do not)."""
    block = mmap.mmap(-1, DIRECT_ALIGNMENT)  # page-aligned
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    try:
        return os.pwrite(fd, block, 0) == DIRECT_ALIGNMENT
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(directory / "probe")


def placed(tensors: dict[str, torch.Tensor], page_offset: int) -> dict[str, torch.Tensor]:
    """Copies of `tensors` in memory that starts `page_offset` bytes after a page boundary."""
    copies = {}
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        memory = mmap.mmap(-1, page_offset + nbytes)  # page-aligned
        copy = torch.frombuffer(memory, dtype=tensor.dtype, offset=page_offset, count=tensor.numel())
        copies[key] = copy.view(tensor.shape).copy_(tensor)
    return copies


@pytest.mark.parametrize("page_offset", [0, 64, 4032])
def test_large_tensors_are_written_with_o_direct_in_whole_blocks(tmp_path, pwrites, page_offset):
    if not supports_direct_writes(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes (covered by the fallback test)")
    pwrites.clear()  # the probe's
    tensors = placed(values(), page_offset)
    assert all(t.untyped_storage().data_ptr() % DIRECT_ALIGNMENT == page_offset for t in tensors.values())
    request = dc.save(sharded(tensors), tmp_path, TorchDistSaveShardedStrategy(thread_count=1, crc32=False))
    assert request is None
    assert_loads_and_verifies(tmp_path)
    # the blocks between the first and the last page boundary of each large tensor's memory
    head = -page_offset % DIRECT_ALIGNMENT
    nbytes = [math.prod(shape) * 4 for k, shape in SHAPES.items() if k in ("big", "odd")]
    whole_blocks = [(n - head) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT for n in nbytes]
    assert sum(length for _, length in pwrites) == sum(whole_blocks)
    assert all(offset % DIRECT_ALIGNMENT == 0 and length % DIRECT_ALIGNMENT == 0 for offset, length in pwrites)


def test_async_staged_tensors_are_written_with_o_direct(tmp_path, pwrites):
    if not supports_direct_writes(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes (covered by the fallback test)")
    pwrites.clear()
    save(tmp_path, asynchronous=True)
    assert_loads_and_verifies(tmp_path)
    nbytes = sum(math.prod(shape) * 4 for k, shape in SHAPES.items() if k in ("big", "odd"))
    assert nbytes - 4 * DIRECT_ALIGNMENT <= sum(length for _, length in pwrites) <= nbytes


def test_a_file_system_refusing_the_alignment_gets_the_page_cache(tmp_path, monkeypatch):
    def refuse(fd: int, data, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)
    save(tmp_path, asynchronous=True)
    assert_loads_and_verifies(tmp_path)


def test_a_failing_direct_write_fails_the_save(tmp_path, monkeypatch):
    if not supports_direct_writes(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes")

    def full(fd: int, data, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(dc.CheckpointingException, match="No space left"):
        save(tmp_path, asynchronous=True)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this OS")
def test_writeback_is_started_every_writeback_bytes_over_the_whole_file(tmp_path, monkeypatch):
    monkeypatch.setattr(filesystem_async, "WRITEBACK_BYTES", 4096)
    requested: list[tuple[int, int]] = []
    fadvise = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        requested.append((offset, length))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    monkeypatch.setattr(filesystem_async, "open_direct", lambda path, flags: None)  # everything through the page cache
    save(tmp_path, asynchronous=False)

    # the ranges follow each other from the file's start, each at least 4096 bytes, up to its last 4096 bytes
    assert requested[0][0] == 0 and all(length >= 4096 for _, length in requested)
    assert all(offset + length == following for (offset, length), (following, _) in zip(requested, requested[1:]))
    assert sum(requested[-1]) > (tmp_path / "__0_0.distcp").stat().st_size - 4096
    assert_loads_and_verifies(tmp_path)

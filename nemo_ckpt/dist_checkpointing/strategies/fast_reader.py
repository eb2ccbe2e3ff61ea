"""Reading torch_dist items straight from their `.distcp` files, without `torch.load`.

Every DCP item is a `torch.save` zip at (file, offset, length). For a tensor, the zip holds
`data.pkl` (dtype, shape, strides), `byteorder` and the raw storage bytes in an uncompressed
`data/<key>` entry. `read_items` reads the zip's directory (`zipfile`, from the
item's first and last few KiB), unpickles `data.pkl` with an allow-list of three names, and
reads the needed bytes with `preadv` straight into the destination tensor (or into a staging
buffer when the destination view or the stored box is not contiguous, or lives on another
device), files in parallel threads, and within a file by `READ_STREAMS` sequential readers with a
descriptor each, `READ_CHUNK` bytes per read (one stream per file leaves the disk idle between its
requests), the next items' reads queued while an item completes (no idle readers between items).
Items it does not understand (transforms, other byte orders, compressed or unknown entries,
other pickles) are returned for DCP's own reader.

With the checkpoint's checksums (`integrity.FileVerifier`), reads are also split where checksum ranges start, the
reader that read a piece computes its CRC32C right after, and every range holding a byte that was used is checked
before `read_items` returns (a ShardedObject's bytes before they are unpickled); what a range holds beyond the
bytes read (the rest of a tensor a rank reads part of, items left to DCP's reader) is read for it.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ..._compat import storage_type_dtypes
from ..core import CheckpointingException
from ..integrity import Checksums, FileVerifier

EDGE_BYTES = 4096  # read at both ends of an item: the zip's metadata
READ_CHUNK = 8 << 20  # bytes per read call of a large tensor
READ_STREAMS = 4  # parallel sequential readers per file
STREAM_RUN = 128 << 20  # bytes a reader reads in a row
STAGING_BYTES = 256 << 20  # staging buffers (non-contiguous boxes, other devices) queued per file, at most
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"
_STORAGE_DTYPES = storage_type_dtypes()


@dataclass(frozen=True)
class RawTensor:
    """Where a `torch.save`d tensor's elements lie in a file: element (i...) is at
    `data_offset + (storage_offset + sum(i_d * stride_d)) * itemsize`."""

    data_offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


@dataclass(frozen=True)
class _Rebuild:
    storage: tuple
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor_v2(
    storage: tuple,
    storage_offset: int,
    size: tuple,
    stride: tuple,
    requires_grad: bool,
    backward_hooks: Any,
    metadata: Any = None,
) -> _Rebuild:
    if backward_hooks or metadata:
        raise pickle.UnpicklingError("tensor with hooks or metadata")
    return _Rebuild(storage, storage_offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """Reads a `torch.save`d plain tensor's `data.pkl` as a `_Rebuild` (nothing else)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> tuple:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"persistent id {pid!r}")
        return pid


class _ItemView:
    """A read-only file object over one item (`offset`, `length`) of a file, for `zipfile`.

    The item's first and last `EDGE_BYTES` (all of a small item) are read once, up front: they
    hold the zip's metadata (`data.pkl`, `byteorder`, local headers, central directory).
    """

    def __init__(self, fd: int, offset: int, length: int, verifier: FileVerifier | None = None) -> None:
        self.fd, self.offset, self.length, self.pos, self.verifier = fd, offset, length, 0, verifier
        if length <= 2 * EDGE_BYTES:
            self.head = self.tail = os.pread(fd, length, offset)
        else:
            self.head = os.pread(fd, EDGE_BYTES, offset)
            self.tail = os.pread(fd, EDGE_BYTES, offset + length - EDGE_BYTES)
        if verifier is not None:  # kept to check the records parsed from them (`get`), not the tensor bytes
            verifier.add_bytes(offset, self.head, used=False)
            if self.tail is not self.head:
                verifier.add_bytes(offset + length - len(self.tail), self.tail, used=False)

    def get(self, pos: int, n: int) -> bytes:
        if pos < 0 or pos + n > self.length:
            raise ValueError(f"bytes [{pos}, {pos + n}) are outside the item")
        if self.verifier is not None:
            self.verifier.require(self.offset + pos, self.offset + pos + n)
        tail_start = self.length - len(self.tail)
        if pos + n <= len(self.head):
            return self.head[pos : pos + n]
        if pos >= tail_start:
            return self.tail[pos - tail_start : pos - tail_start + n]
        return os.pread(self.fd, n, self.offset + pos)

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n < 0 else min(n, self.length - self.pos)
        data = self.get(self.pos, n)
        self.pos += len(data)
        return data

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True


def _stored_entry(view: _ItemView, info: zipfile.ZipInfo) -> tuple[int, int]:
    """(data position in the item, size) of an uncompressed, unencrypted zip entry."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1 or info.compress_size != info.file_size:
        raise ValueError(f"{info.filename} is compressed or encrypted")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(view.get(info.header_offset, _LOCAL_HEADER.size))
    if signature != _LOCAL_SIGNATURE:
        raise ValueError(f"bad local header for {info.filename}")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len, info.file_size


def locate_tensor(fd: int, offset: int, length: int, verifier: FileVerifier | None = None) -> RawTensor | None:
    """The raw layout of the `torch.save`d plain tensor at `offset`; None if it is anything else. The bytes it reads
    are registered with `verifier`."""
    view = _ItemView(fd, offset, length, verifier)
    try:
        with zipfile.ZipFile(view) as archive:
            entries = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
            pos, size = _stored_entry(view, entries["byteorder"])
            if view.get(pos, size).decode() != sys.byteorder:
                return None
            pos, size = _stored_entry(view, entries["data.pkl"])
            rebuilt = _TensorPickle(io.BytesIO(view.get(pos, size))).load()
            if not isinstance(rebuilt, _Rebuild):
                return None
            _, dtype, key, _, numel = rebuilt.storage
            data_pos, data_size = _stored_entry(view, entries[f"data/{key}"])
    except (
        KeyError,
        ValueError,
        TypeError,
        UnicodeDecodeError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        struct.error,
        EOFError,
    ):
        return None
    last = rebuilt.storage_offset + sum((n - 1) * s for n, s in zip(rebuilt.size, rebuilt.stride))
    if data_size != numel * dtype.itemsize or min(rebuilt.stride, default=0) < 0:
        return None
    if math.prod(rebuilt.size) and last >= numel:
        return None
    return RawTensor(offset + data_pos, dtype, rebuilt.size, rebuilt.stride, rebuilt.storage_offset)


class _ReadStreams:
    """`READ_STREAMS` readers of one file, each a thread with its own descriptor (its own readahead state). The
    file is dealt out in runs of `STREAM_RUN` bytes, round robin, so each reader reads sequentially, and its
    reads of `READ_CHUNK` bytes (on multiples of `READ_CHUNK` in the file) are queued in file order. Readers
    sharing one descriptor at interleaved offsets defeat the kernel's readahead: 2-20% slower in our A/B runs."""

    def __init__(self, path: Path, verifier: FileVerifier | None = None) -> None:
        self.verifier = verifier
        self.fds: list[int] = []
        self.readers: list[ThreadPoolExecutor] = []
        try:
            for stream in range(READ_STREAMS):
                self.fds.append(os.open(path, os.O_RDONLY))
                os.posix_fadvise(self.fds[-1], 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self.readers.append(ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-range-reader-{stream}"))
        except BaseException:
            self.close()
            raise

    def submit(self, tensor: torch.Tensor, offset: int) -> list[Future]:
        """Reads filling the contiguous CPU `tensor` with the file's bytes at `offset` (split where checksum ranges
        start, each piece's CRC32C computed by its reader)."""
        nbytes = tensor.numel() * tensor.element_size()
        view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
        reads, start = [], 0
        while start < nbytes:
            position = offset + start
            end = min(nbytes, start + READ_CHUNK - position % READ_CHUNK)
            boundary = self.verifier.next_boundary(position) if self.verifier is not None else None
            if boundary is not None:
                end = min(end, boundary - offset)
            stream = position // STREAM_RUN % READ_STREAMS
            reads.append(self.readers[stream].submit(_read, self.fds[stream], view[start:end], position, self.verifier))
            start = end
        return reads

    def __enter__(self) -> _ReadStreams:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the queued reads, close the descriptors."""
        for reader in self.readers:
            reader.shutdown()
        for fd in self.fds:
            os.close(fd)


def _read(fd: int, view: memoryview, offset: int, verifier: FileVerifier | None) -> None:
    _pread_all(fd, view, offset)
    if verifier is not None:
        verifier.add_read(offset, view)


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise CheckpointingException(f"Unexpected end of checkpoint file at byte {offset}")
        view, offset = view[n:], offset + n


def _is_row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def read_box(
    raw: RawTensor,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    target: torch.Tensor,
    streams: _ReadStreams,
) -> tuple[int, Callable[[], None]]:
    """Start copying the box (`offsets`, `lengths`) of the stored tensor `raw` into `target` (reads queued on
    `streams`); returns the bytes of staging memory it holds and a function that waits for the reads and
    completes `target`."""
    if tuple(target.shape) != tuple(lengths):
        raise CheckpointingException(f"Read target shape {tuple(target.shape)} does not match the box {lengths}")
    if any(o + n > size for o, n, size in zip(offsets, lengths, raw.size)) or len(lengths) != len(raw.size):
        raise CheckpointingException(f"Box at {offsets} of size {lengths} is outside the stored chunk {raw.size}")
    if math.prod(lengths) == 0:
        return 0, lambda: None
    first = raw.storage_offset + sum(o * s for o, s in zip(offsets, raw.stride))
    span = 1 + sum((n - 1) * s for n, s in zip(lengths, raw.stride))
    itemsize = target.element_size()
    start = raw.data_offset + first * itemsize
    direct = (
        span == target.numel()
        and _is_row_major(lengths, raw.stride)
        and target.dtype == raw.dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
    )
    if direct:
        reads = streams.submit(target, start)
        return 0, lambda: _wait(reads)
    # a GPU target (`ckpt_load_directly_on_device`) is filled from pinned memory without blocking the reader
    staging = torch.empty(span, dtype=raw.dtype, pin_memory=target.is_cuda)
    reads = streams.submit(staging, start)

    def finish() -> None:
        _wait(reads)
        target.copy_(staging.as_strided(lengths, raw.stride), non_blocking=target.is_cuda)

    return span * itemsize, finish


def _wait(reads: list[Future]) -> None:
    for read in reads:
        read.result()


@dataclass(frozen=True)
class _PendingRead:
    """An item whose reads are submitted: `finish` waits for them and completes `target`."""

    req: ReadItem
    target: torch.Tensor
    staging: int
    finish: Callable[[], None]

    def complete(self, planner: LoadPlanner) -> int:
        """Wait for the reads, hand the target to the planner; returns the bytes of staging memory freed."""
        self.finish()
        planner.commit_tensor(self.req, self.target)
        return self.staging


def _read_file(
    path: Path, items: list[tuple[ReadItem, Any]], planner: LoadPlanner, verifier: FileVerifier | None = None
) -> list[ReadItem]:
    """Read `items` (with their storage info) from one file; returns those left for DCP's reader.

    First every tensor item is located (small reads at item boundaries), then the reads of every
    item are queued in file order (those into staging buffers up to `STAGING_BYTES` ahead of the item
    being completed), and the items completed in that order. With `verifier`, every checksum range holding a
    byte used (items left to DCP's reader included) is checked before it returns.
    """
    items = sorted(items, key=lambda pair: pair[1].offset)
    left: list[ReadItem] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        located: dict[Any, RawTensor | None] = {}
        for req, info in items:
            if getattr(info, "transform_descriptors", None):
                located[req.storage_index] = None
            elif req.type != LoadItemType.BYTE_IO and req.storage_index not in located:
                located[req.storage_index] = locate_tensor(fd, info.offset, info.length, verifier)
        with _ReadStreams(path, verifier) as streams:
            pending: deque[_PendingRead] = deque()
            staged = 0  # bytes of the pending items' staging buffers
            for req, info in items:
                if req.type == LoadItemType.BYTE_IO and located.get(req.storage_index, True) is not None:
                    data = os.pread(fd, info.length, info.offset)
                    if verifier is not None:  # before the bytes are unpickled
                        verifier.add_bytes(info.offset, data)
                        verifier.check(fd)
                    planner.load_bytes(req, io.BytesIO(data))
                elif located[req.storage_index] is None:
                    if verifier is not None:
                        verifier.require(info.offset, info.offset + info.length)
                    left.append(req)
                else:
                    target = planner.resolve_tensor(req).detach()
                    box = tuple(req.storage_offsets), tuple(req.lengths)
                    staging, finish = read_box(located[req.storage_index], *box, target, streams)
                    pending.append(_PendingRead(req, target, staging, finish))
                    staged += staging
                    while staged > STAGING_BYTES and len(pending) > 1:
                        staged -= pending.popleft().complete(planner)
            while pending:
                pending.popleft().complete(planner)
        if verifier is not None:
            verifier.check(fd)
    finally:
        os.close(fd)
    return left


def read_items(
    root: Path,
    storage_data: dict,
    items: list[ReadItem],
    planner: LoadPlanner,
    thread_count: int,
    checksums: Checksums | None = None,
) -> list[ReadItem]:
    """Read what the fast path understands, files in parallel, checking what is read against `checksums` (if
    any); returns the items DCP's reader must read (checked too)."""
    per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
    for req in items:
        info = storage_data[req.storage_index]
        per_file.setdefault(info.relative_path, []).append((req, info))
    jobs = [
        (Path(root) / name, file_items, checksums.verifier(name) if checksums is not None else None)
        for name, file_items in per_file.items()
    ]
    workers = max(1, min(thread_count, len(jobs)))
    if workers == 1:
        results = [_read_file(path, file_items, planner, verifier) for path, file_items, verifier in jobs]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-file-reader") as pool:
            results = list(pool.map(lambda job: _read_file(*job[:2], planner, job[2]), jobs))
    return [req for file_left in results for req in file_left]

"""Writing torch_dist data in three steps, so the middle one can run in the background.

1. `prepare_write_data` (training side): stage this rank's shards as CPU tensors (a copy for async
   saves, so training may change the originals; with `StagingBuffers` into the memory of the
   previous save; GPU shards into pinned memory on a side stream, without blocking the host, and with
   `defer_device_copies` without holding up the current stream until `order_after_deferred_copies`) and split
   them into `thread_count` files.
2. `write` (any thread): waits for the GPU copies, then writes each file `__<rank>_<i>.distcp` by its own
   thread, fsynced (`write_files`; async saves staged into shared memory are written by the writer process of
   `writer_process.py`, outside the training process's GIL); every item serialized as
   `torch.distributed.checkpoint.FileSystemWriter` does (a `torch.save` zip, at the offset DCP's metadata
   records), with or without the zip's CRC-32s (`torch.load` never checks them; computing them is most of a
   save's CPU time). Large tensors go from their memory to the disk with O_DIRECT, the rest through the page
   cache with early writeback (`ItemFileStream`). Each item's CRC32C is computed from the bytes it wrote, by a
   thread of the file's own, while the writer goes on with the next items and the disk writes these (see
   `integrity.py`).
3. `finish` (training side, collective): gather the write results; the coordinator writes DCP's
   `.metadata` (atomically, fsynced; marked as written with checksums, `integrity.CHECKSUMS_MARKER`) and
   `checksums.json`. With a `MetadataCache`, ranks whose shards have the same structure as last time send nothing
   but their write results.

No planning collective is needed: the items are already deduplicated (main replicas only).
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..._compat import StorageInfo, dcp_write_item, write_tensor
from ..core import CheckpointingException
from ..fault_points import pause_point
from ..integrity import (
    CHECKSUMS_FNAME,
    CHECKSUMS_MARKER,
    FileRanges,
    checksum_ranges,
    extend,
    file_checksum,
    write_checksums,
)
from .async_utils import AsyncRequest
from .direct_io import DIRECT_ALIGNMENT, DIRECT_MIN_BYTES, direct_span, open_direct
from .writer_process import ArenaTensor, SharedArena, shared_memory_available, shared_writer_process

DCP_METADATA_FNAME = ".metadata"
COMMON_FNAME = "common.pt"  # written by the common strategy before the coordinator writes the checksums
KEEP_BY_REFERENCE = 1 << 20
WRITEBACK_BYTES = 32 << 20  # bytes written to a file after which the kernel is asked to start writing them out
DIRECT_CHUNK = 64 << 20  # bytes per O_DIRECT write call
ItemData = torch.Tensor | io.BytesIO


@dataclass
class MetadataCache:
    """What the last save looked like: this rank's items and (on the coordinator) everyone's."""

    local_items: list[WriteItem] | None = None
    all_items: list[list[WriteItem]] = field(default_factory=list)
    state_dict_metadata: dict = field(default_factory=dict)


def _item_nbytes(item: WriteItem, data: ItemData) -> int:
    if isinstance(data, io.BytesIO):
        return data.getbuffer().nbytes
    return data.numel() * data.element_size()


def _needs_copy(tensor: torch.Tensor, copy: bool) -> bool:
    """Whether `tensor` must be copied into a contiguous CPU tensor owning exactly its bytes (torch.save
    writes a tensor's whole storage)."""
    owns_storage = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return copy or tensor.device.type != "cpu" or not owns_storage or not tensor.is_contiguous()


class StagingBuffers:
    """The CPU tensors a save copies its shards into, kept for the next save of the same structure.

    Copying into memory that is already mapped costs a fraction of copying into new memory (which is
    faulted in page by page). A save borrows the buffers from `stage` until its write is done; a
    save staged while an earlier one still writes from them copies into new memory. For GPU shards the
    buffers are pinned and filled with non-blocking copies on a side stream (`DeviceToHostCopies`). They hold
    one copy of this rank's shards in host memory between saves.

    With `writer_process` (Linux), the buffers of CPU shards' copies (async saves) are tensors of one
    `SharedArena`, and `write_in_process` has this process's `shared_writer_process` write the files from them.
    """

    def __init__(self, writer_process: bool = False) -> None:
        self._buffers: dict[MetadataIndex, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._lent = False
        self._shared = writer_process and shared_memory_available()
        self._arena: SharedArena | None = None
        self._places: dict[MetadataIndex, ArenaTensor] = {}

    def stage(self, data: dict, copy: bool) -> tuple[dict, Callable[[], None]]:
        """`data` as CPU tensors (`copy`: never the originals) and the function that returns the buffers."""
        with self._lock:
            reuse, self._lent = not self._lent, True
        try:
            if reuse:
                self._place_in_shared_memory(data, copy)
            staged = _copy_into(data, self._buffers if reuse else {}, copy)
        except BaseException:
            if reuse:
                self._release()
            raise
        if not reuse:
            return staged, lambda: None
        self._buffers = {
            index: tensor
            for index, tensor in staged.items()
            if isinstance(tensor, torch.Tensor) and tensor is not data[index]
        }
        return staged, self._release

    def _release(self) -> None:
        with self._lock:
            self._lent = False

    def _place_in_shared_memory(self, data: dict, copy: bool) -> None:
        """Make the buffers tensors of a shared arena that fits `data` (copies of CPU tensors only), or forget the
        arena where `data` does not go there."""
        tensors = {index: value for index, value in data.items() if isinstance(value, torch.Tensor)}
        if not (self._shared and copy and not any(t.is_cuda for t in tensors.values())):
            self._arena, self._places = None, {}
            return
        specs = {index: (tensor.dtype, tuple(tensor.shape)) for index, tensor in tensors.items()}
        if {index: (place.dtype, place.shape) for index, place in self._places.items()} == specs:
            return
        self._arena = SharedArena(list(specs.values()))
        self._buffers = dict(zip(specs, self._arena.tensors))
        self._places = dict(zip(specs, self._arena.places))

    def write_in_process(self, staged: dict, write: Callable[[dict], WrittenFiles]) -> WrittenFiles | None:
        """`write(staged)` run by the writer process, if every tensor of `staged` is a buffer in the shared arena
        and the process is free; else None (the caller writes)."""
        if self._arena is None or any(
            isinstance(value, torch.Tensor) and value is not self._buffers.get(index) for index, value in staged.items()
        ):
            return None
        places = {index: self._places.get(index, value) for index, value in staged.items()}
        done, written = shared_writer_process().try_call(self._arena, write, places)
        return written if done else None


def _copy_into(data: dict, buffers: dict[MetadataIndex, torch.Tensor], copy: bool) -> dict:
    """`data` staged on CPU, into `buffers` where their shape and dtype still fit."""
    staged: dict = {}
    for index, value in data.items():
        if isinstance(value, io.BytesIO):
            staged[index] = io.BytesIO(value.getvalue()) if copy else value
        elif _needs_copy(value, copy):
            buffer = buffers.get(index)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
            staged[index] = buffer.copy_(value, non_blocking=value.is_cuda)
        else:
            staged[index] = value
    return staged


class DeviceToHostCopies:
    """Where shards live on a GPU: the copies made inside this context go on a side stream into pinned memory,
    without blocking the host. The stream first waits for the work already queued (the shards' values are
    final). At the end of the context the current stream waits for the copies, so no later kernel can change a
    shard before it is copied; with `defer`, it does not, and the copies overlap whatever the current stream does
    next, until `order_after_deferred_copies` (called before anything changes a shard: the next optimizer step, a
    load). `wait` (the writer, before reading the copies) blocks until they are done. On CPU-only data it does
    nothing."""

    _streams: dict[int, torch.cuda.Stream] = {}
    _deferred: list[torch.cuda.Event] = []  # copies that the current stream has not been ordered after yet

    def __init__(self, data: dict, defer: bool = False) -> None:
        self.sources = [v for v in data.values() if isinstance(v, torch.Tensor) and v.is_cuda]
        self.stream = self._side_stream() if self.sources else None
        self.defer = defer
        self.done: torch.cuda.Event | None = None
        self._context = None

    @classmethod
    def _side_stream(cls) -> torch.cuda.Stream:
        device = torch.cuda.current_device()
        if device not in cls._streams:
            cls._streams[device] = torch.cuda.Stream()
        return cls._streams[device]

    def __enter__(self) -> DeviceToHostCopies:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.stream is None:
            return
        self._context.__exit__(*exc_info)
        for source in self.sources:
            source.record_stream(self.stream)  # its memory is not reused before the copy is done
        self.done = torch.cuda.Event()
        self.done.record(self.stream)
        if self.defer:
            self._deferred.append(self.done)
        else:
            torch.cuda.current_stream().wait_event(self.done)
        self.sources = []

    def wait(self) -> None:
        """Block until the copies are in host memory."""
        if self.done is not None:
            self.done.synchronize()


def order_after_deferred_copies() -> None:
    """Make the current CUDA stream wait for the deferred device-to-host copies of earlier saves (see
    `DeviceToHostCopies`): kernels queued from now on run after them. The host does not block."""
    deferred = DeviceToHostCopies._deferred
    while deferred:
        torch.cuda.current_stream().wait_event(deferred.pop())


def split_into_files(items: list[WriteItem], data: dict, bins: int) -> list[list[WriteItem]]:
    """`bins` lists of items with about equal bytes (largest first to the lightest file)."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    for item in sorted(items, key=lambda it: -_item_nbytes(it, data[it.index])):
        lightest = sizes.index(min(sizes))
        buckets[lightest].append(item)
        sizes[lightest] += _item_nbytes(item, data[item.index])
    return [bucket for bucket in buckets if bucket] or [[]]


class FileSystemWriterAsync:
    """One rank's part of a torch_dist save, split into prepare / write / finish (see module doc)."""

    def __init__(
        self,
        checkpoint_dir: Path,
        thread_count: int = 1,
        cache: MetadataCache | None = None,
        crc32: bool = True,
        staging: StagingBuffers | None = None,
        checksums: bool = True,
        defer_device_copies: bool = False,
    ) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count={thread_count}: use 1 or more writer threads (files) per rank")
        self.checkpoint_dir = Path(checkpoint_dir)
        self.thread_count = thread_count
        self.cache = cache
        self.crc32 = crc32
        self.staging = staging
        self.checksums: FileRanges | None = {} if checksums else None
        self.release_staging: Callable[[], None] = lambda: None
        self.copies = DeviceToHostCopies({})
        self.defer_device_copies = defer_device_copies
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.items: list[WriteItem] = []
        self.buckets: list[list[WriteItem]] = []
        self.data: dict = {}
        self.results: list[WriteResult] = []
        self.in_process = False

    def prepare_write_data(self, items: list[WriteItem], data: dict, copy: bool) -> None:
        """Stage the data on CPU (`copy`: never the originals; into the kept buffers of `staging`, if
        any) and assign items to files. Copies (async saves) in the staging's shared memory are written by its
        writer process."""
        self.items = items
        self.in_process = copy and self.staging is not None
        with DeviceToHostCopies(data, self.defer_device_copies) as copies:
            if self.staging is None:
                self.data = _copy_into(data, {}, copy)
            else:
                self.data, self.release_staging = self.staging.stage(data, copy)
        self.copies = copies
        self.buckets = split_into_files(items, self.data, self.thread_count)

    def write(self) -> None:
        """Write every file (one thread each) and keep the write results for `finish`."""
        write = partial(
            write_files, self.checkpoint_dir, self.rank, self.buckets, self.crc32, self.checksums is not None
        )
        try:
            self.copies.wait()
            written = self.staging.write_in_process(self.data, write) if self.in_process else None
            self.results, self.checksums = written or write(self.data)
        finally:
            self.data = {}
            self.release_staging()

    def finish(self) -> None:
        """Collective: gather write results; the coordinator (rank 0) writes `.metadata`."""
        cache = self.cache
        unchanged = cache is not None and cache.local_items == self.items
        payload = (None if unchanged else self.items, self.results, self.checksums)
        gathered = [None] * dist.get_world_size() if dist.is_initialized() else None
        if dist.is_initialized():
            dist.gather_object(payload, gathered if self.rank == 0 else None, dst=0)
        else:
            gathered = [payload]
        error = None
        if self.rank == 0:
            try:
                self._write_metadata(gathered)
            except OSError as e:
                error = f"Failed to write {self.checkpoint_dir / DCP_METADATA_FNAME}: {e}"
        if dist.is_initialized():
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise CheckpointingException(error)
        if cache is not None:
            cache.local_items = self.items

    def _write_metadata(self, gathered: list) -> None:
        pause_point("before-dcp-metadata")
        cache = self.cache or MetadataCache()
        all_items = [items if items is not None else cache.all_items[rank] for rank, (items, *_) in enumerate(gathered)]
        if any(items is not None for items, *_ in gathered) or not cache.state_dict_metadata:
            cache.state_dict_metadata = build_state_dict_metadata(all_items)
            cache.all_items = all_items
        storage_data = {wr.index: wr.storage_data for _, results, _ in gathered for wr in results}
        per_rank = [checksums for *_, checksums in gathered]
        with_checksums = all(ranges is not None for ranges in per_rank)
        save_id = f"{CHECKSUMS_MARKER if with_checksums else ''}{uuid.uuid4()}"
        metadata = Metadata(
            state_dict_metadata=cache.state_dict_metadata,
            storage_data=storage_data,
            storage_meta=StorageMeta(checkpoint_id=str(self.checkpoint_dir), save_id=save_id),
            version=CURRENT_DCP_VERSION,
        )
        mcore_data = megatron_core_data(cache.all_items)
        if mcore_data:  # an attribute of the pickled metadata, as megatron-core's own `MCoreMetadata` has
            metadata.mcore_data = mcore_data
        document = pickle.dumps(metadata)
        tmp = self.checkpoint_dir / f"{DCP_METADATA_FNAME}.tmp"
        with open(tmp, "wb") as stream:
            stream.write(document)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, self.checkpoint_dir / DCP_METADATA_FNAME)
        if not with_checksums:  # a stale checksums file would fail the next load
            (self.checkpoint_dir / CHECKSUMS_FNAME).unlink(missing_ok=True)
            return
        files = {name: r for ranges in per_rank for name, r in ranges.items()}
        files[DCP_METADATA_FNAME] = [[0, len(document), extend(0, document)]]
        if (self.checkpoint_dir / COMMON_FNAME).is_file():
            files[COMMON_FNAME] = [file_checksum(self.checkpoint_dir / COMMON_FNAME)]
        write_checksums(self.checkpoint_dir, files)


class ItemFileStream:
    """The file a writer thread appends its items to, as the stream torch's zip writer writes into.

    - Errors: a failed write (disk full, I/O error) is raised after torch's zip writer is done with the stream.
      torch's writer turns a failed write into a C++ exception, and a second one from its destructor aborts the
      process; here the first error is kept, later writes are dropped, and `raise_deferred_error` raises it.
    - Checksums: with `keep_pieces`, the bytes written since the last `take_pieces` are kept for their checksum:
      pieces of `KEEP_BY_REFERENCE` bytes or more by reference (the tensors' memory, alive until the file is
      written), smaller ones (the zip's headers, which may be the writer's temporaries) as copies.
    - O_DIRECT: a tensor of `DIRECT_MIN_BYTES` or more is placed by `align_for_direct_write` so that its bytes
      lie at the same offsets within file blocks as within memory pages; its whole blocks then go from memory to
      the disk with O_DIRECT (the first and last partial blocks through the page cache): no copy into the page
      cache, and next to no CPU time, which a sync save would spend and an async save's writer would take from
      training. Where the file system refuses O_DIRECT, the page cache is used.
    - Writeback: of the bytes that go through the page cache, every `WRITEBACK_BYTES` are handed to the disk
      at once (`POSIX_FADV_DONTNEED`: on Linux it starts the writeback of the range's dirty pages and drops its
      clean ones), so the disk works while the writer copies the next bytes, where otherwise writeback waits for
      the closing fsync (or the kernel's dirty threshold, 10% of memory); the save leaves no page cache behind.
    """

    def __init__(self, path: Path, keep_pieces: bool = False) -> None:
        self.file = open(path, "wb")
        self.direct_fd = open_direct(path, os.O_WRONLY)
        self.error: OSError | None = None
        self.position = 0
        self.written_back = 0
        self.keep_pieces = keep_pieces
        self.pieces: list[memoryview | bytes] = []

    def __enter__(self) -> ItemFileStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self._close_direct()
        self.file.close()

    def align_for_direct_write(self, tensor: torch.Tensor) -> int | None:
        """If `tensor`'s bytes can be written with O_DIRECT, pad the file with zeros so that its storage, placed on a
        block boundary of the `torch.save` zip, lies at the same offset within a file block as in memory within a
        page; returns the storage alignment that zip must use, else None."""
        storage = tensor.untyped_storage()
        if self.direct_fd is None or storage.nbytes() < DIRECT_MIN_BYTES:
            return None
        padding = (storage.data_ptr() - self.position) % DIRECT_ALIGNMENT
        if padding:
            self.write(bytes(padding))
        return DIRECT_ALIGNMENT

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.keep_pieces:
            self.pieces.append(view if view.nbytes >= KEEP_BY_REFERENCE else bytes(view))
        if self.error is None:
            try:
                head, body = 0, 0
                if self.direct_fd is not None and view.nbytes >= DIRECT_MIN_BYTES:
                    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
                    head, body = direct_span(address, self.position, view.nbytes)
                self._write_buffered(view[:head], self.position)
                body = self._write_direct(view[head : head + body], self.position + head)
                self._write_buffered(view[head + body :], self.position + head + body)
            except OSError as error:
                self.error = error
        self.position += view.nbytes
        return view.nbytes

    def _write_direct(self, view: memoryview, position: int) -> int:
        """Write `view` (whole blocks, aligned) at `position` with O_DIRECT; returns how many bytes (0: none, the
        file system refused the alignment)."""
        if not view.nbytes:
            return 0
        self.file.flush()
        try:
            for start in range(0, view.nbytes, DIRECT_CHUNK):
                _pwrite_all(self.direct_fd, view[start : start + DIRECT_CHUNK], position + start)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self._close_direct()  # the file system wants other alignments: the page cache from here on
            return 0
        self.file.seek(position + view.nbytes)
        self.written_back = position + view.nbytes
        return view.nbytes

    def _write_buffered(self, view: memoryview, position: int) -> None:
        for start in range(0, view.nbytes, WRITEBACK_BYTES):
            piece = view[start : start + WRITEBACK_BYTES]
            self.file.write(piece)
            end = position + start + piece.nbytes
            if end - self.written_back >= WRITEBACK_BYTES:
                self.file.flush()
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(
                        self.file.fileno(), self.written_back, end - self.written_back, os.POSIX_FADV_DONTNEED
                    )
                self.written_back = end

    def _close_direct(self) -> None:
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None

    def tell(self) -> int:
        return self.position

    def take_pieces(self) -> list[memoryview | bytes]:
        """The bytes written since the last call (none without `keep_pieces`)."""
        pieces, self.pieces = self.pieces, []
        return pieces

    def flush(self) -> None:
        """Data reaches the disk at the end of the file's write, with one flush and fsync."""

    def raise_deferred_error(self) -> None:
        if self.error is not None:
            raise self.error


WrittenFiles = tuple[list[WriteResult], FileRanges | None]


def write_files(
    checkpoint_dir: Path, rank: int, buckets: list[list[WriteItem]], crc32: bool, checksums: bool, data: dict
) -> WrittenFiles:
    """Write `buckets[i]`'s items of `data` into `__<rank>_<i>.distcp`, a thread per file; returns the write
    results and, with `checksums`, each file's checksummed ranges."""
    names = [f"__{rank}_{i}.distcp" for i in range(len(buckets))]
    ranges: FileRanges | None = {} if checksums else None
    write = partial(_write_file, checkpoint_dir, data, crc32, ranges)
    if len(buckets) == 1:
        return write(names[0], buckets[0]), ranges
    with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckpt-file-writer") as pool:
        return [r for rs in pool.map(write, names, buckets) for r in rs], ranges


def _write_file(
    checkpoint_dir: Path, data: dict, crc32: bool, checksums: FileRanges | None, name: str, items: list[WriteItem]
) -> list[WriteResult]:
    results: list[WriteResult] = []
    crcs: list[Future[list[list[int]]]] = []
    with (
        ItemFileStream(checkpoint_dir / name, keep_pieces=checksums is not None) as stream,
        ThreadPoolExecutor(1, thread_name_prefix="ckpt-file-checksum") as checksummer,
    ):

        def end_range(start: int) -> None:
            """The bytes from `start` on get their checksum ranges (`integrity.checksum_ranges`), computed while
            the writer goes on with the next items and the disk writes these."""
            if checksums is not None:
                crcs.append(checksummer.submit(checksum_ranges, start, stream.take_pieces()))

        for item in items:
            value = data[item.index]
            start = stream.tell()
            if isinstance(value, io.BytesIO):
                value.seek(0)
                results.append(dcp_write_item(stream, value, item, name))
            else:
                alignment = stream.align_for_direct_write(value)
                if stream.tell() > start:  # the padding before the item: a range of its own
                    end_range(start)
                    start = stream.tell()
                results.append(_write_tensor_item(stream, value, item, name, crc32, alignment))
            end_range(start)
        stream.raise_deferred_error()
        stream.file.flush()
        os.fsync(stream.file.fileno())
        if checksums is not None:
            checksums[name] = [checksum_range for crc in crcs for checksum_range in crc.result()]
    if name.endswith("_0.distcp"):  # the rank's first file (`__<rank>_<i>.distcp`)
        pause_point("distcp-written")
    return results


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"O_DIRECT write at offset {offset} wrote nothing")
        view, offset = view[written:], offset + written


def _write_tensor_item(
    stream: ItemFileStream, tensor: torch.Tensor, item: WriteItem, name: str, crc32: bool, alignment: int | None
) -> WriteResult:
    """`torch.save(tensor, stream)` (with zero CRC-32s unless `crc32`; its storage's bytes `alignment`-aligned in
    the zip), recorded as DCP records its items."""
    offset = stream.tell()
    write_tensor(stream, tensor, crc32, alignment)
    length = stream.tell() - offset
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=StorageInfo(name, offset, length))


@dataclass(frozen=True)
class ReformulatedWriteItem(WriteItem):
    """A flattened-range shard of an N-D tensor stored in Megatron-Core <= 0.18's reformulated layout (see
    `torch.py:reformulated_write`); `original_shape`: the tensor's real global shape, which the metadata's
    `mcore_data` records, as megatron-core's reader requires."""

    original_shape: tuple[int, ...] = ()


def megatron_core_data(all_items: list[list[WriteItem]]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Megatron-Core's `mcore_data` of the reformulated tensors among `all_items` (empty: none)."""
    return {
        item.index.fqn: {"nd_reformulated_orig_global_shape": item.original_shape}
        for items in all_items
        for item in items
        if isinstance(item, ReformulatedWriteItem)
    }


def build_state_dict_metadata(all_items: list[list[WriteItem]]) -> dict:
    """DCP's global metadata: for each key, its size, dtype and every rank's chunks (in rank order)."""
    metadata: dict = {}
    for items in all_items:
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                metadata[item.index.fqn] = BytesStorageMetadata()
                continue
            tensor_data = item.tensor_data
            entry = metadata.setdefault(
                item.index.fqn, TensorStorageMetadata(tensor_data.properties, tensor_data.size, [])
            )
            entry.chunks.append(tensor_data.chunk)
    return metadata


def save_request(
    items: list[WriteItem],
    data: dict,
    checkpoint_dir: Path,
    thread_count: int,
    copy_to_cpu: bool,
    cache: MetadataCache | None = None,
    crc32: bool = True,
    staging: StagingBuffers | None = None,
    checksums: bool = True,
    defer_device_copies: bool = False,
) -> AsyncRequest:
    """Stage the data now; the request writes it (`async_fn`) and finishes the DCP checkpoint (finalize)."""
    writer = FileSystemWriterAsync(checkpoint_dir, thread_count, cache, crc32, staging, checksums, defer_device_copies)
    writer.prepare_write_data(items, data, copy=copy_to_cpu)
    return AsyncRequest(writer.write, (), [writer.finish])

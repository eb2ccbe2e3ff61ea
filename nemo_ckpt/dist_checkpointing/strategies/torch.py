"""The `torch_dist` backend: shards stored with torch.distributed.checkpoint (DCP).

On disk (compatible with Megatron-Core): every ShardedTensor key is a DCP tensor with the
real global shape, each saved shard one DCP chunk. A flat shard (`flattened_range`) of an
N-D tensor on a regular grid is stored as Megatron-Core <= 0.18 stores it (reformulated:
one row per local shard, the real shape in the metadata's `mcore_data`), so megatron-core
0.15 reads it; any other flat shard (and all with `reformulate_flattened=False`, for
megatron-core 0.19 and plain DCP) as the few rectangular boxes its flat range covers.
Both reshard to any layout. Every ShardedObject is a DCP bytes item named by its
`unique_key` holding `torch.save([obj])`.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace, nested_values
from ..fault_points import pause_point
from ..integrity import Checksums, CorruptCheckpointError, Corruption, expected_checksums, safe_relative_path
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, flat_range_boxes, is_main_replica
from ..safe_globals import DCPMetadataUnpickler, UnsafeCheckpointError, safe_torch_load
from .async_utils import AsyncRequest
from .base import LoadShardedStrategy, SaveShardedStrategy, load_device
from .fast_reader import read_items
from .filesystem_async import MetadataCache, ReformulatedWriteItem, StagingBuffers, save_request

DCP_METADATA_FNAME = ".metadata"
COMMON_STATE_KEY = "common_state"


@dataclass
class _Chunk:
    """A box of a global tensor held by a local tensor view of shape `sizes`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: torch.Tensor


def sharded_tensor_chunks(sh_ten: ShardedTensor) -> list[_Chunk]:
    """The global-tensor boxes covered by `sh_ten`, each with a view into `sh_ten.data`."""
    data = sh_ten.data
    prepend = sh_ten.prepend_axis_num
    if sh_ten.flattened_range is None:
        view = data[(None,) * prepend] if prepend else data
        return [_Chunk(sh_ten.global_offset, (1,) * prepend + sh_ten.local_shape, view)]
    chunks, pos = [], 0
    rng = sh_ten.flattened_range
    for box_offset, box_size in flat_range_boxes(sh_ten.local_shape, rng.start, rng.stop):
        numel = math.prod(box_size)
        view = data[pos : pos + numel].view((1,) * prepend + box_size)
        offsets = sh_ten.global_offset[:prepend] + tuple(
            g + o for g, o in zip(sh_ten.global_offset[prepend:], box_offset)
        )
        chunks.append(_Chunk(offsets, (1,) * prepend + box_size, view))
        pos += numel
    return chunks


def is_reformulated_on_save(sh_ten: ShardedTensor) -> bool:
    """Whether `sh_ten` is saved in Megatron-Core <= 0.18's reformulated layout: an N-D tensor's flattened range
    (its distributed optimizer's `fully_sharded_model_space` state) on a regular grid, which megatron-core 0.15
    reads only in that layout."""
    return sh_ten.flattened_range is not None and len(sh_ten.global_shape) > 1 and sh_ten.has_regular_grid


def reformulated_write(sh_ten: ShardedTensor) -> ReformulatedWriteItem:
    """The write item of a flattened range in the reformulated layout: the tensor of shape `fragmentation +
    (numel of a local shard,)` holds each local shard flattened in one row; this range is part of one row."""
    fragmentation = tuple(sh_ten.axis_fragmentations)
    rng = sh_ten.flattened_range
    size = torch.Size(fragmentation + (math.prod(sh_ten.local_shape),))
    offsets = torch.Size(sh_ten.local_chunk_offset_in_global() + (rng.start,))
    sizes = torch.Size((1,) * len(fragmentation) + (rng.stop - rng.start,))
    return ReformulatedWriteItem(
        index=MetadataIndex(sh_ten.key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets, sizes), properties=TensorProperties(dtype=sh_ten.dtype), size=size
        ),
        original_shape=tuple(sh_ten.global_shape),
    )


def _serialize_objects(objs: list[Any]) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(objs, buf)
    buf.seek(0)
    return buf


def build_write_items(
    sharded_state_dict: ShardedStateDict, reformulate_flattened: bool = True
) -> tuple[list[WriteItem], dict[MetadataIndex, torch.Tensor | io.BytesIO]]:
    """DCP write items (and their data) for the main replicas in `sharded_state_dict`; flattened ranges of N-D
    tensors reformulated as Megatron-Core <= 0.18 stores them unless not `reformulate_flattened`."""
    items: list[WriteItem] = []
    data: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
    objects: dict[str, list[Any]] = defaultdict(list)
    for sh_base in nested_values(sharded_state_dict):
        if not is_main_replica(sh_base.replica_id):
            continue
        if isinstance(sh_base, ShardedObject):
            objects[sh_base.unique_key].append(sh_base.data)
            continue
        if not isinstance(sh_base, ShardedTensor):
            raise CheckpointingException(f"Unexpected entity to save: {type(sh_base)}")
        if sh_base.data is None:
            raise CheckpointingException(f"`data` is None for {sh_base}; nothing to save")
        if reformulate_flattened and is_reformulated_on_save(sh_base):
            item = reformulated_write(sh_base)
            items.append(item)
            data[item.index] = sh_base.data.detach().contiguous().view(item.tensor_data.chunk.sizes)
            continue
        chunks = sharded_tensor_chunks(sh_base)
        empty_tensor = math.prod(sh_base.global_shape) == 0
        for chunk in chunks:
            if math.prod(chunk.sizes) == 0 and not empty_tensor:
                continue
            index = MetadataIndex(sh_base.key, chunk.offsets)
            tensor = chunk.tensor.detach()
            items.append(
                WriteItem(
                    index=index,
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(chunk.offsets), torch.Size(chunk.sizes)),
                        properties=TensorProperties(dtype=sh_base.dtype),
                        size=torch.Size(sh_base.global_shape),
                    ),
                )
            )
            data[index] = tensor if tensor.is_contiguous() else tensor.contiguous()
    for unique_key, objs in objects.items():
        index = MetadataIndex(unique_key)
        items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        data[index] = _serialize_objects(objs)
    return items, data


class TorchDistSaveShardedStrategy(SaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects in torch.distributed.checkpoint's format.

    Collective: every rank must call `save` (or `async_save`) with its own shards.

    Args:
        backend: format name recorded in metadata.json.
        version: format version recorded in metadata.json.
        thread_count: writer threads per rank (files per rank).
        cached_metadata: keep the checkpoint structure between saves; ranks whose shards did not
            change send only their write results to the coordinator.
        crc32: compute the CRC-32s of the tensors' zip entries, as `torch.save` does by default.
            False writes zeros (like torch's `compute_crc32=False`): `torch.load` (DCP,
            Megatron-Core, this library) reads the files alike and never checks them, but other
            zip tools report the entries as corrupt. Saves take about half the CPU time.
        reuse_staging_buffers: keep the CPU copies of an async save (and of GPU shards) for the next
            save, which copies into them instead of into new memory (see `StagingBuffers`).
        writer_process: with `reuse_staging_buffers`, keep the copies of CPU shards in shared memory and have a
            persistent process write async saves from there, outside this process's GIL (Linux; see
            `writer_process.py`); False (default): a thread of this process writes them.
        checksums: compute a CRC32C of every written item in the writer threads and store them in
            `checksums.json` (see `integrity.py`), for `verify`.
        defer_device_copies: GPU shards' copies into host memory overlap the work queued after the save on the
            current stream (the next forward and backward) instead of going before it; the caller must call
            `order_after_deferred_copies()` before anything changes a saved tensor (the optimizer step, a load).
            False (default): the save returns with the current stream ordered after the copies.
        reformulate_flattened: store the flattened ranges of N-D tensors (a distributed optimizer's
            `fully_sharded_model_space` state) as Megatron-Core <= 0.18 does, reformulated with the metadata's
            `mcore_data`, which megatron-core 0.15 needs to load them into its flattened templates. False: as
            rectangular boxes of the real shape, which megatron-core 0.19 and plain DCP read as whole tensors
            (0.19 no longer reads the reformulated layout). This library reads both.
    """

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        thread_count: int = 2,
        cached_metadata: bool = False,
        crc32: bool = True,
        reuse_staging_buffers: bool = False,
        checksums: bool = True,
        writer_process: bool = False,
        defer_device_copies: bool = False,
        reformulate_flattened: bool = True,
    ) -> None:
        super().__init__(backend, version)
        self.reformulate_flattened = reformulate_flattened
        self.checksums = checksums
        self.thread_count = thread_count
        self.cached_metadata = cached_metadata
        self.crc32 = crc32
        self._metadata_cache = MetadataCache() if cached_metadata else None
        self._staging = StagingBuffers(writer_process) if reuse_staging_buffers else None
        self.defer_device_copies = defer_device_copies

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        items, data = build_write_items(sharded_state_dict, self.reformulate_flattened)
        save_request(
            items,
            data,
            checkpoint_dir,
            self.thread_count,
            False,
            self._metadata_cache,
            self.crc32,
            self._staging,
            self.checksums,
            self.defer_device_copies,
        ).execute_sync()

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
        """Copy this rank's main replicas to CPU now; the request writes them and finishes the checkpoint."""
        items, data = build_write_items(sharded_state_dict, self.reformulate_flattened)
        return save_request(
            items,
            data,
            checkpoint_dir,
            self.thread_count,
            True,
            self._metadata_cache,
            self.crc32,
            self._staging,
            self.checksums,
            self.defer_device_copies,
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that reads `.metadata` with a restricted unpickler (once), checks its fields (no file
    outside the checkpoint, no overlapping or negative ranges, sizes within the files), reports a missing or corrupt
    file clearly and reads tensors straight into their destination (`.fast_reader`; DCP's own reader for anything
    else), `thread_count` files at a time. With `verify`, every byte read is checked against the checkpoint's
    checksums (`integrity.py`) before `read_data` returns."""

    def __init__(
        self, path: str | os.PathLike, allow_unsafe_pickle: bool = False, thread_count: int = 2, verify: bool = True
    ) -> None:
        super().__init__(path)
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.thread_count = thread_count
        self.verify = verify
        self._metadata: Metadata | None = None
        self._checksums: Checksums | None = None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        left = read_items(self.path, self.storage_data, plan.items, planner, self.thread_count, self._checksums)
        if left:
            return super().read_data(LoadPlan(left), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        path = os.path.join(self.path, DCP_METADATA_FNAME)
        if not os.path.isfile(path):
            raise CheckpointingException(f"{path} is missing: {self.path} is not a complete torch_dist checkpoint")
        with open(path, "rb") as f:
            data = f.read()
        self._checksums = expected_checksums(self.path, self.verify)
        if self._checksums is not None:
            self._checksums.check_file(DCP_METADATA_FNAME, data)
        try:
            if self.allow_unsafe_pickle:
                metadata = pickle.loads(data)
            else:
                metadata = DCPMetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as e:
            if "is not allowed" in str(e):
                raise UnsafeCheckpointError(
                    f"Refused to read {path}: {e}. If you trust this checkpoint, pass allow_unsafe_pickle=True."
                ) from e
            raise CheckpointingException(f"{path} is corrupt: {e}") from e
        except (EOFError, ValueError, AttributeError, TypeError, KeyError, IndexError, MemoryError, OverflowError) as e:
            raise CheckpointingException(f"{path} is corrupt: {e!r}") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointingException(f"{path} does not hold DCP metadata (got {type(metadata)})")
        _check_metadata_fields(metadata, path)
        _check_storage_entries(metadata, Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._metadata = metadata
        return metadata


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Loads precomputed read items into local chunk views and ShardedObject slots."""

    def __init__(
        self, items: list[ReadItem], chunks: dict[str, list[_Chunk]], checkpoint_dir: Path, allow_unsafe_pickle: bool
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items = items
        self._chunks = chunks
        self._checkpoint_dir = checkpoint_dir
        self._allow_unsafe_pickle = allow_unsafe_pickle
        self.loaded_objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        chunk = self._chunks[read_item.dest_index.fqn][read_item.dest_index.index]
        view = chunk.tensor
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Data was copied into a view of the destination: nothing to do."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        where = f"ShardedObject '{key}' in {self._checkpoint_dir}"
        objs = safe_torch_load(value, where, self._allow_unsafe_pickle)
        self.loaded_objects[key] = objs[0] if isinstance(objs, list) and objs else objs


def _check_storage_files(read_items: list[ReadItem], metadata: Metadata, checkpoint_dir: Path) -> None:
    """Raise a clear error if a file the plan reads from is missing or too short."""
    needed: dict[str, tuple[int, str]] = {}
    for item in read_items:
        info = metadata.storage_data[item.storage_index]
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (0, ""))[0]:
            needed[info.relative_path] = (end, item.storage_index.fqn)
    for rel_path, (end, key) in needed.items():
        path = os.path.join(checkpoint_dir, rel_path)
        if not os.path.isfile(path):
            raise CheckpointingException(f"Checkpoint file {path} is missing (needed for key '{key}')")
        _raise_if_truncated(checkpoint_dir, rel_path, end, key)


def _describe_keys(keys: Any, limit: int = 20) -> str:
    keys = sorted(keys)
    more = f" ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads ShardedTensors and ShardedObjects from a torch_dist checkpoint.

    Each rank reads only what its shards need, without collectives.

    Args:
        allow_unsafe_pickle: unpickle ShardedObjects and `.metadata` without the
            allow-list. Only for trusted checkpoints.
        thread_count: files read at the same time by this rank.
        verify_checksums: check every byte read against the stored checksums (`integrity.py`).
        load_directly_on_device: tensors without template data are allocated on the current accelerator
            (if any) instead of CPU; tensors with template data are loaded into it, wherever it lives.
    """

    backend = "torch_dist"

    def __init__(
        self,
        allow_unsafe_pickle: bool = False,
        thread_count: int = 2,
        load_directly_on_device: bool = False,
        verify_checksums: bool = True,
    ) -> None:
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.thread_count = thread_count
        self.load_directly_on_device = load_directly_on_device
        self.verify_checksums = verify_checksums

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _reader(self, checkpoint_dir: Path) -> SafeFileSystemReader:
        return SafeFileSystemReader(checkpoint_dir, self.allow_unsafe_pickle, self.thread_count, self.verify_checksums)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        reader = self._reader(checkpoint_dir)
        metadata = reader.read_metadata()
        chunks: dict[str, list[_Chunk]] = defaultdict(list)
        objects: dict[str, list[ShardedObject]] = defaultdict(list)
        by_key: dict[str, ShardedTensor] = {}
        for sh_base in nested_values(sharded_state_dict):
            if isinstance(sh_base, ShardedObject):
                objects[sh_base.unique_key].append(sh_base)
            elif isinstance(sh_base, ShardedTensor):
                _prepare_for_load(sh_base, load_device(self.load_directly_on_device))
                chunks[sh_base.key] += sharded_tensor_chunks(sh_base)
                by_key.setdefault(sh_base.key, sh_base)
            else:
                raise CheckpointingException(f"Unexpected entity to load: {type(sh_base)}")

        items: list[ReadItem] = []
        copy_backs: list[Callable[[], None]] = []
        for key, key_chunks in list(chunks.items()):
            if _is_reformulated(metadata, by_key[key]):
                cells, copy_back = _reformulated_cells(key_chunks, by_key[key], metadata.state_dict_metadata[key])
                chunks[key] = cells
                copy_backs.append(copy_back)
                items += _tensor_read_items(key, cells, by_key[key], metadata, checkpoint_dir, reformulated=True)
            else:
                items += _tensor_read_items(key, key_chunks, by_key[key], metadata, checkpoint_dir)
        for unique_key in objects:
            md = metadata.state_dict_metadata.get(unique_key)
            if not isinstance(md, BytesStorageMetadata):
                raise CheckpointingException(f"ShardedObject '{unique_key}' not found in checkpoint {checkpoint_dir}")
            index = MetadataIndex(unique_key)
            zero = torch.Size([0])
            items.append(ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero))
        _check_storage_files(items, metadata, checkpoint_dir)

        planner = _ChunkLoadPlanner(items, chunks, checkpoint_dir, self.allow_unsafe_pickle)
        _dcp_load(reader, planner, checkpoint_dir)
        pause_point("restore-read")
        for copy_back in copy_backs:
            copy_back()

        def unwrap(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                return x.data
            if isinstance(x, ShardedObject):
                return planner.loaded_objects[x.unique_key]
            return x

        return dict_list_map_outplace(unwrap, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = self._reader(checkpoint_dir).read_metadata()
        mcore_data = getattr(metadata, "mcore_data", None) or {}
        return {
            key: ShardedTensor.from_rank_offsets(
                key, torch.empty(_original_shape(key, md, mcore_data), dtype=md.properties.dtype, device="meta")
            ).without_data()
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = self._reader(checkpoint_dir).read_metadata()
        sharded_metadata: ShardedStateDict = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                sharded_metadata[sh_obj.unique_key] = sh_obj
        sharded_metadata.update(self.load_tensors_metadata(checkpoint_dir))
        return sharded_metadata


def _check_metadata_fields(metadata: Metadata, path: str) -> None:
    """Raise a clear error if unpickled metadata lacks the fields loading reads (a damaged `.metadata`)."""
    try:
        if not isinstance(metadata.storage_data, dict) or not isinstance(metadata.state_dict_metadata, dict):
            raise TypeError("storage_data or state_dict_metadata is not a mapping")
        for index, info in metadata.storage_data.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info.relative_path, str):
                raise TypeError(f"storage entry {index!r}: {info!r}")
            if not (_is_count(info.offset) and _is_count(info.length)):
                raise ValueError(f"storage entry {index.fqn!r} has offset {info.offset!r} and length {info.length!r}")
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                if not isinstance(md.properties.dtype, torch.dtype) or not all(map(_is_count, md.size)):
                    raise ValueError(f"tensor {key!r} has dtype {md.properties.dtype!r} and size {md.size!r}")
                _check_chunks(key, md, metadata.storage_data)
            elif not isinstance(md, BytesStorageMetadata):
                raise TypeError(f"unexpected entry {type(md).__name__}")
            elif MetadataIndex(key) not in metadata.storage_data:
                raise ValueError(f"object {key!r} has no storage entry")
        for key, data in (getattr(metadata, "mcore_data", None) or {}).items():
            shape = tuple(data.get("nd_reformulated_orig_global_shape", ()))
            md = metadata.state_dict_metadata.get(key)
            if shape and (not all(map(_is_count, shape)) or not isinstance(md, TensorStorageMetadata)):
                raise ValueError(f"tensor {key!r}: original shape {shape} of a tensor not stored")
            if shape and math.prod(shape) > math.prod(md.size):
                raise ValueError(f"tensor {key!r}: original shape {shape} is larger than its stored {tuple(md.size)}")
    except (AttributeError, TypeError, ValueError, OverflowError) as e:
        raise CheckpointingException(f"{path} is corrupt: {e}") from e


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_chunks(key: str, md: TensorStorageMetadata, storage_data: dict) -> None:
    """Each chunk of tensor `key` lies inside its shape and has a stored item large enough for its bytes, and the
    chunks hold at least as many elements as the shape: what a load allocates is bounded by the files' sizes."""
    itemsize = md.properties.dtype.itemsize
    held = 0
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        valid = len(offsets) == len(sizes) == len(md.size) and all(map(_is_count, offsets + sizes))
        if not valid or any(o + n > dim for o, n, dim in zip(offsets, sizes, md.size)):
            raise ValueError(f"tensor {key!r}: chunk at {offsets} of size {sizes} is outside its size {tuple(md.size)}")
        info = storage_data.get(MetadataIndex(key, torch.Size(offsets)))
        if info is None:
            raise ValueError(f"tensor {key!r}: chunk at {offsets} has no storage entry")
        if info.length < math.prod(sizes) * itemsize:
            raise ValueError(
                f"tensor {key!r}: chunk at {offsets} holds {math.prod(sizes) * itemsize} bytes, its stored item "
                f"{info.length}"
            )
        held += math.prod(sizes)
    if math.prod(md.size) > held:
        raise ValueError(f"tensor {key!r} of size {tuple(md.size)} has chunks of {held} elements only")


def _check_storage_entries(metadata: Metadata, checkpoint_dir: Path) -> None:
    """Storage entries name files inside `checkpoint_dir` (`integrity.safe_relative_path`), do not overlap, and end
    within their file where it exists (a missing file is reported when a load needs it)."""
    per_file: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for index, info in metadata.storage_data.items():
        per_file[info.relative_path].append((info.offset, info.offset + info.length, index.fqn))
    for name, entries in per_file.items():
        path = safe_relative_path(checkpoint_dir, name, DCP_METADATA_FNAME)
        entries.sort()
        for (_, end, key), (start, _, next_key) in zip(entries, entries[1:]):
            if start < end:
                reason = f"stored items of {key!r} and {next_key!r} overlap in {name}"
                raise CorruptCheckpointError(checkpoint_dir, [Corruption(DCP_METADATA_FNAME, 0, 0, reason)])
        if path.is_file():
            end, key = max((end, key) for _, end, key in entries)
            _raise_if_truncated(checkpoint_dir, name, end, key)


def _raise_if_truncated(checkpoint_dir: Path, name: str, end: int, key: str) -> None:
    size = os.path.getsize(Path(checkpoint_dir) / name)
    if size < end:
        reason = f"truncated: the file has {size} bytes, but key '{key}' needs {end}"
        raise CorruptCheckpointError(checkpoint_dir, [Corruption(name, size, end, reason)])


def _original_shape(key: str, md: TensorStorageMetadata, mcore_data: dict[str, dict[str, Any]]) -> tuple[int, ...]:
    """A stored tensor's shape, or for Megatron-Core <= 0.18's reformulated flattened tensors their real one."""
    return tuple(mcore_data.get(key, {}).get("nd_reformulated_orig_global_shape", md.size))


def _prepare_for_load(sh_ten: ShardedTensor, device: torch.device) -> None:
    """Allocate missing data; zero it where the checkpoint may not cover everything."""
    if sh_ten.data is None:
        sh_ten.init_data(device, init_fn=torch.zeros if sh_ten.allow_shape_mismatch else torch.empty)
    else:
        sh_ten.data = sh_ten.data.detach()
        if sh_ten.allow_shape_mismatch:
            sh_ten.data.zero_()


def _is_reformulated(metadata: Metadata, sh_ten: ShardedTensor) -> bool:
    """Whether the checkpoint stores `sh_ten`'s key in Megatron-Core <= 0.18's layout for flattened-range
    tensors: shape `fragmentation + (numel of a local shard,)`, one row per local shard, flat."""
    mcore_data = getattr(metadata, "mcore_data", None) or {}
    original = mcore_data.get(sh_ten.key, {}).get("nd_reformulated_orig_global_shape")
    md = metadata.state_dict_metadata.get(sh_ten.key)
    return (
        original is not None
        and tuple(original) == sh_ten.global_shape
        and isinstance(md, TensorStorageMetadata)
        and tuple(md.size) != sh_ten.global_shape
    )


def _reformulated_cells(
    chunks: list[_Chunk], sh_ten: ShardedTensor, md: TensorStorageMetadata
) -> tuple[list[_Chunk], Callable[[], None]]:
    """Read plan for a tensor in the reformulated layout: the stored rows (local shards of the saving layout)
    that `chunks` overlap, as chunks of the stored tensor into new buffers, and a function that copies them
    into `chunks` once read."""
    global_shape = sh_ten.global_shape
    fragmentation = tuple(md.size[:-1])
    cell_shape = tuple(g // f for g, f in zip(global_shape, fragmentation))
    if len(fragmentation) != len(global_shape) or math.prod(cell_shape) != md.size[-1]:
        raise CheckpointingException(
            f"Key '{sh_ten.key}' is stored flattened with shape {tuple(md.size)}, which does not split "
            f"its original shape {global_shape} into equal local shards"
        )
    buffers: dict[tuple[int, ...], torch.Tensor] = {}
    overlaps: list[tuple[_Chunk, tuple[int, ...]]] = []
    for chunk in chunks:
        ranges = [
            range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(chunk.offsets, chunk.sizes, cell_shape) if s > 0
        ]
        if len(ranges) < len(cell_shape):
            continue
        for cell in itertools.product(*ranges):
            if cell not in buffers:
                buffers[cell] = torch.empty(md.size[-1], dtype=sh_ten.dtype, device=chunk.tensor.device)
            overlaps.append((chunk, cell))
    cells = [
        _Chunk(cell + (0,), (1,) * len(cell) + (md.size[-1],), buffer.view((1,) * len(cell) + (-1,)))
        for cell, buffer in buffers.items()
    ]

    def copy_back() -> None:
        for chunk, cell in overlaps:
            cell_offset = [i * c for i, c in zip(cell, cell_shape)]
            low = [max(o, co) for o, co in zip(chunk.offsets, cell_offset)]
            high = [min(o + s, co + c) for o, s, co, c in zip(chunk.offsets, chunk.sizes, cell_offset, cell_shape)]
            source = buffers[cell].view(cell_shape)[
                tuple(slice(lo - co, hi - co) for lo, hi, co in zip(low, high, cell_offset))
            ]
            chunk.tensor[tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, chunk.offsets))].copy_(source)

    return cells, copy_back


def _tensor_read_items(
    key: str,
    chunks: list[_Chunk],
    sh_ten: ShardedTensor,
    metadata: Metadata,
    checkpoint_dir: Path,
    reformulated: bool = False,
) -> list[ReadItem]:
    md = metadata.state_dict_metadata.get(key)
    if md is None:
        stored = (k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
        raise CheckpointingException(
            f"Key '{key}' not found in checkpoint {checkpoint_dir}. Stored tensor keys: {_describe_keys(stored)}"
        )
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointingException(f"Key '{key}' in checkpoint {checkpoint_dir} is an object, not a tensor")
    if tuple(md.size) != sh_ten.global_shape and not (sh_ten.allow_shape_mismatch or reformulated):
        raise CheckpointingException(
            f"Global shape mismatch for key '{key}' in checkpoint {checkpoint_dir}: "
            f"stored {tuple(md.size)}, requested {sh_ten.global_shape}"
        )
    if md.properties.dtype != sh_ten.dtype:
        raise CheckpointingException(
            f"Dtype mismatch for key '{key}' in checkpoint {checkpoint_dir}: "
            f"stored {md.properties.dtype}, requested {sh_ten.dtype}"
        )
    local = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in chunks]
    items = create_read_items_for_chunk_list(key, md, local)
    if not sh_ten.allow_shape_mismatch:
        covered = defaultdict(int)
        for item in items:
            covered[item.dest_index.index] += math.prod(item.lengths)
        for i, chunk in enumerate(chunks):
            if covered[i] < math.prod(chunk.sizes):
                raise CheckpointingException(
                    f"Checkpoint {checkpoint_dir} does not hold all of key '{key}' at offsets "
                    f"{chunk.offsets} size {chunk.sizes} (stored chunks do not cover it)"
                )
    return items


def _dcp_load(reader: SafeFileSystemReader, planner: _ChunkLoadPlanner, checkpoint_dir: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        try:
            dcp.load({}, storage_reader=reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as e:
            raise _as_checkpointing_error(e, f"Failed to read checkpoint {checkpoint_dir}") from e


def _as_checkpointing_error(e: BaseException, what: str) -> CheckpointingException:
    """DCP wraps per-rank failures in a CheckpointException (a BaseException): surface the cause."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        e = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    if isinstance(e, CheckpointingException):
        return e
    return CheckpointingException(f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def load_common_state_object(checkpoint_dir: Path, allow_unsafe_pickle: bool = False, verify: bool = True) -> Any:
    """Read the `common_state` ShardedObject (Megatron-Core >= 0.19 stores common data there)."""
    strategy = TorchDistLoadShardedStrategy(allow_unsafe_pickle, verify_checksums=verify)
    sh_obj = ShardedObject(COMMON_STATE_KEY, None, (1,), (0,))
    return strategy.load({"common": sh_obj}, checkpoint_dir)["common"]

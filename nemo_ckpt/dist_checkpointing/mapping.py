"""Classes describing how local tensors and objects map onto global checkpoint entries.

The main entry point is `ShardedTensor.from_rank_offsets`, which wraps a local
tensor as one shard of a larger (global) tensor.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, merge

logger = logging.getLogger(__name__)

StateDict = dict[str, Any]
CommonStateDict = dict[str, Any]
ShardedStateDict = dict[str, Any]
ReplicaId = int | tuple[int, ...]


class ShardedBase(ABC):
    """Base class of every sharded entity: a checkpoint `key`, `data` and a `replica_id`."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException if the metadata attributes are inconsistent."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy with `data=None` (cheap to exchange between ranks)."""


@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor that is one shard of a global tensor.

    Args:
        key: unique identifier of the global tensor in the checkpoint.
        data: local tensor (None only for metadata-only instances).
        dtype: tensor dtype.
        local_shape: shape of the local shard (of the non-flat shard when
            `flattened_range` is set).
        global_shape: shape of the global tensor.
        global_offset: offset of the local shard in the global tensor, in elements.
        axis_fragmentations: number of shards along each axis for a regular grid,
            None for uneven (irregular) sharding.
        replica_id: 0 (or all zeros) marks the main replica, the one that is saved.
        prepend_axis_num: leading global axes the local tensor does not have (like unsqueeze).
        allow_shape_mismatch: on load the stored global shape may differ; missing
            parts are zero-filled and extra parts are dropped (e.g. padded embeddings).
        flattened_range: `data` is `local_tensor.flatten()[flattened_range]`
            (distributed optimizer shards).
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(self.local_shape)
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(self.axis_fragmentations)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(f"Data dtype {self.data.dtype} != `dtype` {self.dtype} for {self}")
            if self.flattened_range is None and tuple(self.data.shape) != self.local_shape:
                raise CheckpointingException(
                    f"Data shape {tuple(self.data.shape)} != `local_shape` {self.local_shape} for {self}"
                )
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"Global offset and global shape have different ndims for {self}")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"Local shape plus `prepend_axis_num` must have as many dims as global shape for {self}"
            )
        if self.axis_fragmentations is not None:
            for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
                if sh != 0 and off % sh != 0:
                    raise CheckpointingException(
                        f"Global offset ({off}) must be divisible by local shape ({sh}) for {self}"
                    )
        if self.flattened_range is not None:
            rng = self.flattened_range
            if rng.step not in (None, 1) or rng.start is None or rng.stop is None:
                raise CheckpointingException(f"`flattened_range` must be a contiguous slice for {self}")
            if not 0 <= rng.start <= rng.stop <= math.prod(self.local_shape):
                raise CheckpointingException(
                    f"`flattened_range` {rng} is outside the local shape {self.local_shape} for {self}"
                )
            if self.data is not None and tuple(self.data.shape) != (rng.stop - rng.start,):
                raise CheckpointingException(
                    f"Flat data shape {tuple(self.data.shape)} != flattened_range length for {self}"
                )

    @property
    def has_regular_grid(self) -> bool:
        """True if the shards form a regular grid (`axis_fragmentations` is set)."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> tuple[int | slice, ...]:
        """Index of the (non-flat) local shard in the global tensor."""
        prepended = self.global_offset[: self.prepend_axis_num]
        rest = zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        return tuple(prepended) + tuple(slice(off, off + sh) for off, sh in rest)

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Offset of the local shard in the grid of shards."""
        chunk_offset = list(self.global_offset[: self.prepend_axis_num])
        for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
            chunk_offset.append(off // sh if sh else 0)
        return tuple(chunk_offset)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """Shard size along each axis implied by `axis_fragmentations`."""
        assert self.axis_fragmentations is not None, f"No regular grid for {self}"
        chunks = []
        for axis_sh, axis_fragm in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and axis_sh % axis_fragm != 0:
                raise CheckpointingException(
                    f"Axis shape ({axis_sh}) not divisible by axis fragmentation ({axis_fragm}) for {self}"
                )
            chunks.append(axis_sh // axis_fragm)
        return tuple(chunks)

    def without_data(self) -> ShardedTensor:
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Build a ShardedTensor from offsets given in ranks.

        Each `(axis, axis_rank_offset, axis_fragm)` says: split the global tensor into
        `axis_fragm` equal parts along `axis`; `data` is part `axis_rank_offset`.
        Axes count global dims (including `prepend_axis_num` prepended ones).
        """
        if flattened_range is not None:
            raise ValueError("Use `from_rank_offsets_flat` for a flat ShardedTensor.")
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        axis_fragmentations = [1] * ndim
        seen_axes = set()
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            if not (0 <= axis < ndim and 0 <= axis_rank_offset < axis_fragm) or axis in seen_axes:
                raise CheckpointingException(f"Invalid rank offsets {rank_offsets} for key {key}")
            seen_axes.add(axis)
            local_axis_shape = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * local_axis_shape
            global_offset[axis] = axis_rank_offset * local_axis_shape
            axis_fragmentations[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice,
        **kwargs: Any,
    ) -> ShardedTensor:
        """Like `from_rank_offsets` for a 1-D `data` that is
        `local.flatten()[flattened_range]` of a local shard of `non_flat_local_shape`."""
        if flattened_range is None:
            raise CheckpointingException(f"`flattened_range` is required for a flat ShardedTensor ({key})")
        if data.ndim != 1:
            raise CheckpointingException(f"Flat data must be 1-D, got shape {tuple(data.shape)} for {key}")
        meta = torch.empty(non_flat_local_shape, dtype=data.dtype, device="meta")
        sh_ten = cls.from_rank_offsets(key, meta, *rank_offsets, **kwargs)
        flat = replace(sh_ten, data=data, flattened_range=flattened_range)
        return flat

    def init_data(self, device: str | torch.device, init_fn: Callable = torch.empty) -> None:
        """Allocate `data` (only if it is None)."""
        if self.data is not None:
            return
        shape = self.local_shape
        if self.flattened_range is not None:
            shape = (self.flattened_range.stop - self.flattened_range.start,)
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """`torch.narrow` applied to every rank's shard (non-flat, regular grid only)."""
        if self.flattened_range is not None:
            raise CheckpointingException(f"narrow is not supported for flat {self}")
        gdim = dim + self.prepend_axis_num
        local_len = self.local_shape[dim]
        if self.global_shape[gdim] % local_len or self.global_offset[gdim] % local_len:
            raise CheckpointingException(f"Only a regular grid can be narrowed, got {self}")
        global_shape = list(self.global_shape)
        global_offset = list(self.global_offset)
        global_shape[gdim] = self.global_shape[gdim] // local_len * length
        global_offset[gdim] = self.global_offset[gdim] // local_len * length
        new_data = self.data.narrow(dim, start, length)
        return [
            replace(
                self,
                data=new_data,
                local_shape=tuple(new_data.shape),
                global_shape=tuple(global_shape),
                global_offset=tuple(global_offset),
            )
        ]

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key='{self.key}')"


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the flat range [start, stop) of a row-major `shape` into (offset, size) boxes.

    The boxes come in flat order and each is contiguous in flat order, so box `i` is
    the next `prod(size_i)` elements of the flat range.
    """
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first, first_rem = divmod(start, inner)
    last, last_rem = divmod(stop, inner)

    def in_row(row: int, lo: int, hi: int) -> list:
        return [((row,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return in_row(first, first_rem, last_rem)
    boxes = []
    if first_rem:
        boxes += in_row(first, first_rem, inner)
        first += 1
    if last > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
    if last_rem:
        boxes += in_row(last, 0, last_rem)
    return boxes


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that gets saved: 0 or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class LocalNonpersistentObject:
    """An object that is not saved; on load the local object is put in the result instead."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """The wrapped object."""
        return self.obj


@dataclass
class ShardedObject(ShardedBase):
    """One element of a global array of arbitrary (picklable) objects.

    Args:
        key: identifier of the global object array.
        data: the local object (None only for metadata-only instances).
        global_shape: shape of the global object array.
        global_offset: position of the local object in that array.
        replica_id: 0 (or all zeros) marks the main replica, the one that is saved.
    """

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"Global offset and global shape have different ndims for {self}")

    def without_data(self) -> ShardedObject:
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """`<key>/shard_<offsets>_<shape>`: the name of this object in the checkpoint."""
        offsets = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key='{self.key}')"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """Parse `<key>/shard_<offsets>_<shape>` into a ShardedObject with `data=None`."""
        key, _, shard_key = unique_key.rpartition("/")
        shard_str, offset_str, shape_str = shard_key.split("_")
        if shard_str != "shard" or not key:
            raise CheckpointingException(f"Not a ShardedObject unique key: {unique_key}")
        offset = tuple(map(int, offset_str.split(".")))
        shape = tuple(map(int, shape_str.split(".")))
        if len(shape) + 1 == len(offset):
            shape += (-1,)  # old format without the last global shape element
        return cls(key, None, shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A deferred transformation of a tensor into a sharded sub state dict.

    `build_fn(key, data, replica_id, flattened_range)` runs before saving (and before
    loading, to know what to read); `merge_fn(loaded_sub_state_dict)` undoes it after
    loading. Because the factory receives the original tensor, the same transformation
    applies to optimizer states of that parameter.
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """Run `build_fn` on this factory's attributes."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before the factory is built."""

    def without_data(self) -> ShardedTensorFactory:
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory with its built sub state dict, in place."""

    def apply(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(apply, sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: tuple = ()) -> StateDict:
    """Undo factories: wherever `x2` holds a ShardedTensorFactory, replace the loaded
    sub state dict at the same place in `x1` with `factory.merge_fn(sub)`. In place."""
    return merge(x1, x2, key, merge_leaf=lambda loaded, factory: factory.merge_fn(loaded))

"""The legacy `zarr` backend, load only: checkpoints written by Megatron-Core's deprecated zarr strategy.

On disk: `<checkpoint>/<key>/` is a zarr (format 2) array with the global shape, chunked by the
saving ranks' local shape, uncompressed; bfloat16 arrays say `"dtype": "bfloat16"` in `.zarray`
(raw 2-byte values). Common data is in `common.pt`. Convert to torch_dist with
`nemo_ckpt.dist_checkpointing.converter`. Needs the `zarr` package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace
from ..mapping import ShardedStateDict, ShardedTensor, StateDict
from .base import LoadShardedStrategy, load_device

ZARR_METADATA_FNAME = ".zarray"
BFLOAT16 = "bfloat16"


def _zarr() -> Any:
    try:
        import zarr
    except ImportError as e:
        raise CheckpointingException("Loading a zarr checkpoint needs the `zarr` package: pip install zarr") from e
    return zarr


def _open_array(path: Path) -> tuple[Any, torch.dtype]:
    """The zarr array at `path` (read only) and its torch dtype; bfloat16 is read as raw 16-bit words."""
    metadata_path = path / ZARR_METADATA_FNAME
    if not metadata_path.is_file():
        raise CheckpointingException(f"Array {path} not found: {metadata_path} is missing")
    zarr = _zarr()
    store: Any = zarr.storage.LocalStore(str(path), read_only=True)
    if json.loads(metadata_path.read_text())["dtype"] == BFLOAT16:
        return zarr.open_array(store=_bfloat16_as_uint16(store), mode="r", zarr_format=2), torch.bfloat16
    array = zarr.open_array(store=store, mode="r", zarr_format=2)
    return array, torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype


def _bfloat16_as_uint16(store: Any) -> Any:
    """Wrap a zarr store so that a `"bfloat16"` array reads as `<u2` (zarr has no bfloat16)."""
    zarr = _zarr()

    class Bfloat16AsUint16Store(zarr.storage.WrapperStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            buffer = await super().get(key, prototype, byte_range)
            if key != ZARR_METADATA_FNAME or buffer is None:
                return buffer
            metadata = json.loads(buffer.to_bytes())
            metadata["dtype"] = "<u2"
            return prototype.buffer.from_bytes(json.dumps(metadata).encode())

    return Bfloat16AsUint16Store(store)


def _to_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def _pad_to_local_shape(x: torch.Tensor, sh_ten: ShardedTensor) -> torch.Tensor:
    """Zero-pad a shard cut short by a smaller stored global shape (`allow_shape_mismatch`)."""
    padded = torch.zeros(sh_ten.local_shape, dtype=x.dtype)
    padded[tuple(slice(0, size) for size in x.shape)] = x
    return padded


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Loads ShardedTensors from a legacy zarr checkpoint (ShardedObjects come from the common strategy).

    Args:
        load_directly_on_device: tensors without template data go to the current accelerator (if any)
            instead of CPU; tensors with template data are loaded into it, wherever it lives.
    """

    backend = "zarr"

    def __init__(self, load_directly_on_device: bool = False) -> None:
        self.load_directly_on_device = load_directly_on_device

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        def load_one(sh_ten: Any) -> torch.Tensor:
            if not isinstance(sh_ten, ShardedTensor):
                raise CheckpointingException(f"{self.__class__.__name__} loads ShardedTensors only, got {type(sh_ten)}")
            return self._load_tensor(sh_ten, Path(checkpoint_dir))

        return dict_list_map_outplace(load_one, sharded_state_dict)

    def _load_tensor(self, sh_ten: ShardedTensor, checkpoint_dir: Path) -> torch.Tensor:
        array, dtype = _open_array(checkpoint_dir / sh_ten.key)
        if tuple(array.shape) != sh_ten.global_shape and not sh_ten.allow_shape_mismatch:
            raise CheckpointingException(
                f"Global shape mismatch for key '{sh_ten.key}' in {checkpoint_dir}: "
                f"stored {tuple(array.shape)}, requested {sh_ten.global_shape}"
            )
        if dtype != sh_ten.dtype:
            raise CheckpointingException(
                f"Dtype mismatch for key '{sh_ten.key}' in {checkpoint_dir}: stored {dtype}, requested {sh_ten.dtype}"
            )
        x = _to_torch(array[sh_ten.global_slice()], dtype)
        if tuple(x.shape) != sh_ten.local_shape:
            x = _pad_to_local_shape(x, sh_ten)
        if sh_ten.flattened_range is not None:
            x = x.flatten()[sh_ten.flattened_range]
        if sh_ten.data is not None:
            return sh_ten.data.detach().copy_(x)
        return x.to(load_device(self.load_directly_on_device))

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        metadata = {}
        for subdir in sorted(Path(checkpoint_dir).iterdir()):
            if (subdir / ZARR_METADATA_FNAME).is_file():
                array, dtype = _open_array(subdir)
                empty = torch.empty(tuple(array.shape), dtype=dtype, device="meta")
                metadata[subdir.name] = ShardedTensor.from_rank_offsets(subdir.name, empty).without_data()
        return metadata

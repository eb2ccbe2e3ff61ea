"""Hugging Face weight files (`*.safetensors`, sharded with `model.safetensors.index.json`), read and written one
tensor at a time.

Reading memory-maps each file: a tensor is a view of the file's pages, read when used, so a whole model's tensors
can be handed to a writer without holding them in memory. Writing lays out the file header from the tensors'
names, dtypes and shapes first, then streams each tensor's bytes, so at most one tensor is in memory. The files
are the format `safetensors` and `transformers` read (https://github.com/huggingface/safetensors#format).
"""

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_ALIGNMENT = 8

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its name in the file, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is not a safetensors file: it is shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def open_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one `.safetensors` file, each a copy-on-write memory map of its own bytes (nothing read yet;
    a tensor owning exactly its storage is written by `dist_checkpointing` without a staging copy)."""
    header, data_start = _read_header(path)
    size = path.stat().st_size
    tensors = {}
    for name, entry in header.items():
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which is not supported")
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        if end > size:
            raise ValueError(f"{path} is truncated: tensor {name!r} ends at byte {end} of {size}")
        dtype = DTYPES[entry["dtype"]]
        if end == begin:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=begin, shape=(end - begin,)))
        if begin % data.element_size() or data.data_ptr() % torch.empty((), dtype=dtype).element_size():
            data = data.clone()  # a misaligned tensor is read into memory
        tensors[name] = data.view(dtype).reshape(entry["shape"])
    return tensors


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory: those its index names, or `model.safetensors`."""
    index = directory / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names weight files that are missing from {directory}: {missing}")
        return [directory / name for name in files]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise FileNotFoundError(
        f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}: save the model with "
        "`save_pretrained(dir, safe_serialization=True)` (PyTorch .bin weights are not read: unpickling runs code)"
    )


def open_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory (sharded or not), memory-mapped."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        tensors.update(open_safetensors(path))
    return tensors


def _write_file(path: Path, specs: list[TensorSpec], produce: Callable[[str], torch.Tensor]) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for spec in specs:
        header[spec.name] = {
            "dtype": DTYPE_NAMES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for spec in specs:
            tensor = produce(spec.name)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                got, expected = f"{tensor.dtype}{list(tensor.shape)}", f"{spec.dtype}{list(spec.shape)}"
                raise ValueError(f"Tensor {spec.name!r} is {got}, expected {expected}")
            file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy


def write_model_weights(
    directory: Path, specs: Iterable[TensorSpec], produce: Callable[[str], torch.Tensor], max_shard_size: int
) -> list[Path]:
    """Write the tensors of `specs` (made one at a time by `produce(name)`) into `directory` as Hugging Face does:
    `model.safetensors`, or shards of at most `max_shard_size` bytes (a larger tensor gets a shard of its own)
    with `model.safetensors.index.json`. Return the files written."""
    shards: list[list[TensorSpec]] = [[]]
    shard_bytes = 0
    for spec in specs:
        if shards[-1] and shard_bytes + spec.nbytes > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(spec)
        shard_bytes += spec.nbytes
    if len(shards) == 1:
        _write_file(directory / SINGLE_FILE, shards[0], produce)
        return [directory / SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_file(directory / name, shard, produce)
    index = {
        "metadata": {"total_size": sum(spec.nbytes for shard in shards for spec in shard)},
        "weight_map": {spec.name: name for name, shard in zip(names, shards) for spec in shard},
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / name for name in names] + [directory / INDEX_FILE]

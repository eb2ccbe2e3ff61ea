"""Hugging Face weight files (`*.safetensors`, sharded with `model.safetensors.index.json`), read and written one
tensor at a time.

Reading memory-maps each file: a tensor is a view of the file's pages, read when used, so a whole model's tensors
can be handed to a writer without holding them in memory. Writing lays out the file header from the tensors'
names, dtypes and shapes first, then streams each tensor's bytes, so at most one tensor is in memory. The files
are the format `safetensors` and `transformers` read (https://github.com/huggingface/safetensors#format).

Nothing outside the model directory is read, and nothing is allocated from a size a file claims before it is checked
against the files: the index may name only files inside the directory (no absolute paths, `..` or symbolic links
leading out), a header's length fits the file (and safetensors' 100 MB limit), each tensor's dtype and shape give
exactly the bytes of its `data_offsets`, which lie within the file and do not overlap. A malformed field raises
`MalformedModelError` naming the file and the field.
"""

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADER_ALIGNMENT = 8
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit

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


class MalformedModelError(ValueError):
    """A file of a Hugging Face model directory is malformed; the message names the file and the field."""


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(path: Path, name: str, entry: object, data_bytes: int) -> tuple[int, int]:
    """The data offsets of a header entry whose fields are consistent and within the file's `data_bytes`."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise MalformedModelError(f"{path}: header entry {name!r} is not a tensor (dtype, shape, data_offsets)")
    if entry["dtype"] not in DTYPES:
        raise MalformedModelError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which is not supported")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(map(_is_count, shape)):
        raise MalformedModelError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes")
    pair = isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
    if not pair or offsets[0] > offsets[1]:
        raise MalformedModelError(f"{path}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    if offsets[1] > data_bytes:
        raise MalformedModelError(
            f"{path} is truncated: tensor {name!r} ends at byte {offsets[1]} of the {data_bytes} data bytes"
        )
    nbytes = math.prod(shape) * DTYPES[entry["dtype"]].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise MalformedModelError(
            f"{path}: tensor {name!r} of dtype {entry['dtype']} and shape {shape} has {nbytes} bytes, but its "
            f"data_offsets {offsets} hold {offsets[1] - offsets[0]}"
        )
    return offsets[0], offsets[1]


def _read_header(path: Path) -> tuple[dict, int]:
    """The tensors' entries of a safetensors file (checked, see the module doc) and where their data starts."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise MalformedModelError(f"{path} is not a safetensors file: it is shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise MalformedModelError(
                f"{path}: header length {length} exceeds the file's {size - 8} bytes after it or the format's limit "
                f"({MAX_HEADER_BYTES})"
            )
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedModelError(f"{path}: the header is not JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.pop("__metadata__", {}), dict):
        raise MalformedModelError(f"{path}: the header is not a JSON object of tensors (and __metadata__)")
    spans = sorted(_check_entry(path, name, entry, size - 8 - length) + (name,) for name, entry in header.items())
    for (_, end, name), (begin, next_end, next_name) in zip(spans, spans[1:]):
        if begin < end and next_end > begin:
            raise MalformedModelError(f"{path}: the data of tensors {name!r} and {next_name!r} overlap")
    return header, 8 + length


def open_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one `.safetensors` file, each a copy-on-write memory map of its own bytes (nothing read yet;
    a tensor owning exactly its storage is written by `dist_checkpointing` without a staging copy)."""
    header, data_start = _read_header(path)
    tensors = {}
    for name, entry in header.items():
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        dtype = DTYPES[entry["dtype"]]
        if end == begin:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", offset=begin, shape=(end - begin,)))
        if begin % data.element_size() or data.data_ptr() % torch.empty((), dtype=dtype).element_size():
            data = data.clone()  # a misaligned tensor is read into memory
        tensors[name] = data.view(dtype).reshape(entry["shape"])
    return tensors


def read_index(directory: Path) -> dict[str, str]:
    """The `weight_map` of `directory`'s shard index (tensor name -> file), each file inside `directory`."""
    index = directory / INDEX_FILE
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise MalformedModelError(f"{index} is not a shard index with a weight_map: {e!r}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise MalformedModelError(f"{index}: weight_map is not a mapping of tensor names to file names")
    root = os.path.realpath(directory)
    for name in set(weight_map.values()):
        inside = os.path.commonpath([root, os.path.realpath(directory / name)]) == root
        if not name or os.path.isabs(name) or ".." in Path(name).parts or not inside:
            raise MalformedModelError(f"{index}: weight file {name!r} is not a file inside {directory}")
    return weight_map


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory: those its index names, or `model.safetensors`."""
    index = directory / INDEX_FILE
    if index.is_file():
        files = sorted(set(read_index(directory).values()))
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
    """Every tensor of a Hugging Face model directory (sharded or not), memory-mapped; a sharded one's tensors each
    in the file its index names, once."""
    weight_map = read_index(directory) if (directory / INDEX_FILE).is_file() else None
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        file_name = path.relative_to(directory).as_posix()
        for name, tensor in open_safetensors(path).items():
            if name in tensors:
                raise MalformedModelError(f"{directory}: tensor {name!r} is in two weight files (the second: {path})")
            if weight_map is not None and os.path.normpath(weight_map.get(name, "")) != os.path.normpath(file_name):
                raise MalformedModelError(
                    f"{path} holds tensor {name!r}, which {directory / INDEX_FILE} places in {weight_map.get(name)!r}"
                )
            tensors[name] = tensor
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

"""Megatron-Core's indexed dataset: a `.bin` token stream and its `.idx` index, byte for byte.

The `.idx` file is `MMIDIDX\\x00\\x00`, `<Q` version 1, `<B` dtype code, `<Q` sequence count, `<Q` document count, then
int32 sequence lengths, int64 byte pointers into the `.bin` file and int64 document indices (the sequence index where
each document ends, starting with 0). Data written here is read by megatron-core's `IndexedDataset` and the other way
round.
"""

import os
import shutil
import struct
from array import array
from collections.abc import Iterable
from enum import Enum
from pathlib import Path

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8


class DType(Enum):
    """The token dtype codes of the `.idx` header (Megatron-Core's numbering)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, dtype: type[np.number] | np.dtype) -> int:
        return cls[np.dtype(dtype).name].value

    @classmethod
    def dtype_from_code(cls, code: int) -> type[np.number]:
        return getattr(np, cls(code).name)

    @staticmethod
    def optimal_dtype(vocab_size: int | None) -> type[np.number]:
        """uint16 below 65,500 tokens, else int32 (as Megatron chooses)."""
        return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def get_idx_path(path_prefix: str | Path) -> str:
    return f"{path_prefix}.idx"


def get_bin_path(path_prefix: str | Path) -> str:
    return f"{path_prefix}.bin"


class IndexedDataset:
    """Memory-mapped reader of a `.bin`/`.idx` pair; item `i` is sequence `i` as a numpy array of the stored dtype.

    Pickles as its path prefix, so DataLoader workers map the files themselves.
    """

    def __init__(self, path_prefix: str | Path) -> None:
        self.path_prefix = str(path_prefix)
        self._open()

    def _open(self) -> None:
        idx_path, bin_path = get_idx_path(self.path_prefix), get_bin_path(self.path_prefix)
        for path, kind in ((idx_path, "index"), (bin_path, "data")):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"Indexed dataset {self.path_prefix!r}: the {kind} file {path} does not exist; pass the path "
                    "prefix without .bin/.idx and write both files with `python -m nemo_ckpt.data.preprocess`"
                )
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = _read_index(idx_path)
        self._itemsize = np.dtype(self.dtype).itemsize
        bin_size = os.path.getsize(bin_path)
        needed = _data_bytes(self.sequence_lengths, self.sequence_pointers, self._itemsize)
        if needed > bin_size:
            raise ValueError(
                f"Indexed dataset {bin_path} is truncated: its index points to byte {needed} but the file has "
                f"{bin_size} bytes; re-run the preprocessing that wrote it"
            )
        self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_size else np.zeros(0, np.uint8)

    def __getstate__(self) -> str:
        return self.path_prefix

    def __setstate__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self._open()

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("Slices into an IndexedDataset must be contiguous (step 1)")
            lengths = self.sequence_lengths[start:stop]
            if not len(lengths):
                return []
            tokens = self._read(int(self.sequence_pointers[start]), int(lengths.sum()))
            return np.split(tokens, np.cumsum(lengths)[:-1])
        return self.get(index)

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset:offset + length` of sequence `index` (to its end when `length` is None)."""
        sequence_length = int(self.sequence_lengths[index])
        if length is None:
            length = sequence_length - offset
        return self._read(int(self.sequence_pointers[index]) + offset * self._itemsize, int(length))

    def head(self, count: int) -> np.ndarray:
        """The first `count` tokens of the data file (fewer if it holds fewer)."""
        return self._read(0, min(count, len(self._bin) // self._itemsize))

    def _read(self, byte_offset: int, count: int) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=byte_offset)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @staticmethod
    def exists(path_prefix: str | Path) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


def _data_bytes(lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """Bytes of the `.bin` file the index refers to."""
    if not len(lengths):
        return 0
    return int((pointers + lengths.astype(np.int64) * itemsize).max())


def _read_index(idx_path: str) -> tuple[type[np.number], np.ndarray, np.ndarray, np.ndarray]:
    """The dtype, sequence lengths, sequence pointers and document indices of an `.idx` file (memory-mapped)."""
    fix = "re-create it with `python -m nemo_ckpt.data.preprocess` (or Megatron's preprocess_data.py)"
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        header = stream.read(_HEADER_BYTES)
    if len(header) < _HEADER_BYTES or header[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise ValueError(f"{idx_path} is not a Megatron indexed-dataset index (no MMIDIDX header); {fix}")
    version, code, sequence_count, document_count = struct.unpack("<QBQQ", header[len(INDEX_HEADER) :])
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_path} has index version {version}; only version {INDEX_VERSION} is supported; {fix}")
    if code not in {d.value for d in DType}:
        raise ValueError(f"{idx_path} has unknown dtype code {code}; {fix}")
    dtype = DType.dtype_from_code(code)
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{idx_path} stores {np.dtype(dtype).name} values, not token ids; {fix}")
    expected = _HEADER_BYTES + sequence_count * (4 + 8) + document_count * 8
    if size < expected:
        raise ValueError(f"{idx_path} is truncated: {size} bytes, its header announces {expected}; {fix}")
    buffer = np.memmap(idx_path, dtype=np.uint8, mode="r")
    offset = _HEADER_BYTES
    lengths = np.frombuffer(buffer, dtype=np.int32, count=sequence_count, offset=offset)
    offset += lengths.nbytes
    pointers = np.frombuffer(buffer, dtype=np.int64, count=sequence_count, offset=offset)
    offset += pointers.nbytes
    documents = np.frombuffer(buffer, dtype=np.int64, count=document_count, offset=offset)
    if document_count == 0 or documents[-1] != sequence_count:
        raise ValueError(f"{idx_path}: its document indices do not end at its {sequence_count} sequences; {fix}")
    return dtype, lengths, pointers, documents


class IndexedDatasetBuilder:
    """Writes a `.bin` file document by document, then its `.idx` at `finalize` (Megatron-Core's builder API)."""

    def __init__(self, bin_path: str | Path, dtype: type[np.number] = np.int32) -> None:
        self.bin_path = str(bin_path)
        self.dtype = np.dtype(dtype).type
        if not np.issubdtype(self.dtype, np.integer):
            raise ValueError(f"IndexedDatasetBuilder: dtype must be an integer type for token ids, got {dtype}")
        self._limits = np.iinfo(self.dtype)
        self._data = open(self.bin_path, "wb")
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])

    def _write(self, tokens: Iterable[int] | np.ndarray) -> int:
        values = np.asarray(tokens)
        if values.size and (values.min() < self._limits.min or values.max() > self._limits.max):
            raise ValueError(
                f"IndexedDatasetBuilder({self.bin_path}): token id {int(values.max())} does not fit "
                f"{np.dtype(self.dtype).name}; choose the dtype from the vocab size: DType.optimal_dtype(vocab_size)"
            )
        self._data.write(values.astype(self.dtype, copy=False).tobytes(order="C"))
        return int(values.size)

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence to the current document (close it with `end_document`)."""
        self.sequence_lengths.append(self._write(tokens))

    def add_document(self, tokens: Iterable[int] | np.ndarray, lengths: Iterable[int]) -> None:
        """Append a whole document: `tokens` holding sequences of `lengths`."""
        lengths = [int(length) for length in lengths]
        written = self._write(tokens)
        if written != sum(lengths):
            raise ValueError(f"add_document: {written} tokens but the lengths sum to {sum(lengths)}")
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str | Path) -> None:
        """Append a whole indexed dataset (a shard written with the same dtype)."""
        dtype, lengths, _, documents = _read_index(get_idx_path(path_prefix))
        if dtype != self.dtype:
            raise ValueError(
                f"add_index: {get_idx_path(path_prefix)} stores {np.dtype(dtype).name}, this builder "
                f"{np.dtype(self.dtype).name}; write every shard with the same dtype"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(lengths.tolist())
        self.document_indices.extend((documents[1:] + offset).tolist())
        with open(get_bin_path(path_prefix), "rb") as source:
            shutil.copyfileobj(source, self._data, length=16 << 20)

    def finalize(self, idx_path: str | Path) -> None:
        """Close the `.bin` file and write the `.idx` file."""
        self._data.close()
        lengths = np.frombuffer(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(self.dtype).itemsize, out=pointers[1:])
        documents = np.frombuffer(self.document_indices, dtype=np.int64)
        with open(idx_path, "wb") as index:
            index.write(INDEX_HEADER)
            index.write(struct.pack("<QB", INDEX_VERSION, DType.code_from_dtype(self.dtype)))
            index.write(struct.pack("<QQ", len(lengths), len(documents)))
            index.write(lengths.tobytes(order="C"))
            index.write(pointers.tobytes(order="C"))
            index.write(documents.tobytes(order="C"))

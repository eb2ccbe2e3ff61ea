"""Checksums of a torch_dist checkpoint's files, and their verification.

The writer computes a CRC32C (hardware-accelerated) of every item it wrote, from its bytes still in memory, in
a thread per file while the next items are written and the disk writes these; the coordinator stores them, with
those of `.metadata` and `common.pt`, in `checksums.json`: `{"algorithm": "crc32c", "files": {name: [[offset,
length, crc], ...]}}`, one range per item (and per padding before an O_DIRECT item), so a corrupt byte is named
by file and offset range. Megatron-Core and torch ignore the file;
checkpoints without it load as before (nothing to verify).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c

from .core import CheckpointingException, write_durably

CHECKSUMS_FNAME = "checksums.json"
ALGORITHM = "crc32c"
READ_BLOCK = 16 << 20

FileRanges = dict[str, list[list[int]]]


def extend(crc: int, data) -> int:
    """`crc` extended by the bytes of `data` (any buffer)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return crc32c.crc32c(view, crc)


def checksum(pieces: list) -> int:
    """The CRC32C of the concatenated `pieces` (buffers)."""
    crc = 0
    for piece in pieces:
        crc = extend(crc, piece)
    return crc


def file_checksum(path: str | Path) -> list[int]:
    """`[0, size, crc]` of a whole file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            crc = extend(crc, block)
            size += len(block)
    return [0, size, crc]


def write_checksums(checkpoint_dir: Path, files: FileRanges) -> None:
    """Store `files` (name -> [[offset, length, crc], ...]) in `checksums.json`, fsynced."""
    document = json.dumps({"algorithm": ALGORITHM, "files": files}, sort_keys=True).encode()
    write_durably(Path(checkpoint_dir) / CHECKSUMS_FNAME, lambda f: f.write(document))


@dataclass(frozen=True)
class Corruption:
    """A range of a checkpoint file whose bytes are not what was written."""

    file: str
    start: int
    stop: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file} bytes [{self.start}, {self.stop}): {self.reason}"


class CorruptCheckpointError(CheckpointingException):
    """A checkpoint's files do not match their checksums."""

    def __init__(self, checkpoint_dir: Path, corruptions: list[Corruption]) -> None:
        self.corruptions = corruptions
        shown = "\n  ".join(map(str, corruptions[:20]))
        more = f"\n  ... (+{len(corruptions) - 20} more)" if len(corruptions) > 20 else ""
        super().__init__(f"Checkpoint {checkpoint_dir} is corrupt:\n  {shown}{more}")


def read_checksums(checkpoint_dir: Path) -> FileRanges | None:
    """The stored checksums, or None for a checkpoint written without them."""
    path = Path(checkpoint_dir) / CHECKSUMS_FNAME
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_bytes())
        if document["algorithm"] != ALGORITHM:
            raise ValueError(f"unknown algorithm {document['algorithm']!r}")
        files = document["files"]
        if not all(isinstance(r, list) and len(r) == 3 for ranges in files.values() for r in ranges):
            raise ValueError("malformed ranges")
        return files
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        corruption = Corruption(CHECKSUMS_FNAME, 0, path.stat().st_size, str(e))
        raise CorruptCheckpointError(checkpoint_dir, [corruption]) from e


def _verify_file(checkpoint_dir: Path, name: str, ranges: list[list[int]]) -> list[Corruption]:
    path = checkpoint_dir / name
    if not path.is_file():
        return [Corruption(name, 0, max(o + n for o, n, _ in ranges), "file is missing")]
    size = path.stat().st_size
    found = []
    with open(path, "rb") as f:
        for offset, length, expected in ranges:
            if offset + length > size:
                found.append(Corruption(name, offset, offset + length, f"truncated: the file has {size} bytes"))
                continue
            crc, position = 0, offset
            while position < offset + length:
                block = os.pread(f.fileno(), min(READ_BLOCK, offset + length - position), position)
                crc = extend(crc, block)
                position += len(block)
            if crc != expected:
                found.append(Corruption(name, offset, offset + length, "checksum mismatch"))
    return found


def verify_checkpoint(
    checkpoint_dir: str | Path, threads: int = 4, progress: Callable[[int, int, str], None] | None = None
) -> list[Corruption] | None:
    """Check every stored checksum of `checkpoint_dir` (files in parallel); return the corruptions found
    (empty: intact), or None if the checkpoint has no checksums; raise if it is missing or not a directory.
    `progress(done, total, file)` after each file."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.exists():
        raise CheckpointingException(f"{checkpoint_dir} does not exist")
    if not checkpoint_dir.is_dir():
        raise CheckpointingException(f"{checkpoint_dir} is not a checkpoint directory: it is a file")
    files = read_checksums(checkpoint_dir)
    if files is None:
        return None
    corruptions: list[Corruption] = []
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-verify") as pool:
        futures = {name: pool.submit(_verify_file, checkpoint_dir, name, ranges) for name, ranges in files.items()}
        for done, (name, future) in enumerate(futures.items(), 1):
            corruptions += future.result()
            if progress is not None:
                progress(done, len(futures), name)
    return corruptions


def raise_if_corrupt(checkpoint_dir: str | Path) -> None:
    """Raise `CorruptCheckpointError` naming every corrupt range (checkpoints without checksums pass)."""
    corruptions = verify_checkpoint(checkpoint_dir)
    if corruptions:
        raise CorruptCheckpointError(Path(checkpoint_dir), corruptions)


def print_progress(done: int, total: int, name: str) -> None:
    """A `progress` callback for the command line: one line per file on stderr."""
    print(f"[{done}/{total}] {name}", file=sys.stderr)

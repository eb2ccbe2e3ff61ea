"""Checksums of a checkpoint's files, checked as a load reads them and by `verify`.

`checksums.json` in a checkpoint directory: `{"algorithm": "crc32c", "crc32c": <its own>, "files": {name:
[[offset, length, crc], ...]}}`, ranges in file order. The torch_dist writer computes a CRC32C of every item it
wrote, from its bytes still in memory, in a thread per file while the next items are written; a tensor's bytes
get ranges of their own, split on file offsets that are multiples of `CHECKSUM_BLOCK` (so a load that reads part
of a tensor checks at most one extra block at each end), the zip records around them one range each. The
coordinator adds whole-file ranges of `.metadata` and `common.pt`, then `metadata.json` before writing it (last).
A training checkpoint's `context/` has a `checksums.json` of its own (whole files). `"crc32c"` is the CRC32C of
the canonical JSON of `"files"`, so a damaged checksums file is named as such.

A load checks every byte it uses (`FileVerifier`: the CRC32C of each read is computed by the thread that read it,
right after the read; ranges read in several pieces are combined with `crc32c_combine`, never read twice), before
the loaded values are returned. Our writer marks `.metadata` (`CHECKSUMS_MARKER` in its save id): a marked
checkpoint whose `checksums.json` is missing is refused (`MissingChecksumsError`) unless verification is turned
off (`load(verify=False)`, `ckpt_verify_on_load=False`). Checkpoints of Megatron-Core, NeMo, or ours from before
the marker carry none and load unverified. Megatron-Core and torch ignore both.
"""

from __future__ import annotations

import bisect
import errno
import functools
import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import crc32c

from .core import CheckpointingException, fsync_path

CHECKSUMS_FNAME = "checksums.json"
ALGORITHM = "crc32c"
READ_BLOCK = 16 << 20  # bytes per read of a range that no load read
CHECKSUM_BLOCK = 8 << 20  # a tensor's bytes get a range per block of the file
LARGE_PIECE = 1 << 20  # a write of this many bytes or more (a tensor's storage) gets ranges of its own
CHECKSUMS_MARKER = "nemo_ckpt.crc32c.v1:"  # the prefix of the save id our writer stores in `.metadata`
DCP_METADATA_FNAME = ".metadata"
_DOCUMENT_KEYS = {"algorithm", "files", "crc32c"}
_POLY = 0x82F63B78  # CRC32C, reflected

FileRanges = dict[str, list[list[int]]]


def extend(crc: int, data) -> int:
    """`crc` extended by the bytes of `data` (any buffer)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return crc32c.crc32c(view, crc)


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC32C polynomial (reflected bit order)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) modulo the polynomial, k = 0..63."""
    powers = [1 << 30]  # x^1
    for _ in range(63):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_POWERS = _powers()


@functools.lru_cache(maxsize=256)
def _shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial."""
    operator, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            operator = _multiply(_X_POWERS[k], operator)
        n >>= 1
        k += 1
    return operator


def crc32c_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC32C of A + B from that of A (`crc1`), that of B (`crc2`) and B's length."""
    return _multiply(_shift_operator(length2), crc1) ^ crc2 if length2 else crc1


def checksum_ranges(start: int, pieces: list) -> list[list[int]]:
    """`[offset, length, crc]` ranges of `pieces` (buffers written one after another from file offset `start`): each
    piece of `LARGE_PIECE` bytes or more in ranges of its own, split on file offsets multiple of `CHECKSUM_BLOCK`;
    the smaller pieces between them one range per run."""
    ranges: list[list[int]] = []
    position, run_start, crc = start, start, 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if view.nbytes < LARGE_PIECE:
            crc = extend(crc, view)
            position += view.nbytes
            continue
        if position > run_start:
            ranges.append([run_start, position - run_start, crc])
        done = 0
        while done < view.nbytes:
            end = min(view.nbytes, done + CHECKSUM_BLOCK - (position + done) % CHECKSUM_BLOCK)
            ranges.append([position + done, end - done, extend(0, view[done:end])])
            done = end
        position += view.nbytes
        run_start, crc = position, 0
    if position > run_start:
        ranges.append([run_start, position - run_start, crc])
    return ranges


def file_checksum(path: str | Path) -> list[int]:
    """`[0, size, crc]` of a whole file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            crc = extend(crc, block)
            size += len(block)
    return [0, size, crc]


def _files_crc(files: FileRanges) -> int:
    return extend(0, json.dumps(files, sort_keys=True, separators=(",", ":")).encode())


def write_checksums(directory: Path, files: FileRanges) -> None:
    """Store `files` (name -> [[offset, length, crc], ...]) in `directory/checksums.json`, atomically and fsynced."""
    document = {"algorithm": ALGORITHM, "crc32c": _files_crc(files), "files": files}
    path = Path(directory) / CHECKSUMS_FNAME
    tmp = path.with_name(f"{CHECKSUMS_FNAME}.tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(document, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def record_file_checksum(directory: Path, name: str, data: bytes) -> None:
    """Add the whole-file checksum of `name`, about to be written with `data`, to `directory`'s checksums (if it has
    any)."""
    if not (Path(directory) / CHECKSUMS_FNAME).is_file():
        return
    files = dict(_read_document(Path(directory)).files)
    files[name] = [[0, len(data), extend(0, data)]]
    write_checksums(directory, files)


def write_directory_checksums(directory: str | Path) -> None:
    """Whole-file checksums of every file under `directory` (e.g. a training checkpoint's `context/`) into its
    `checksums.json`, fsynced with the directory."""
    directory = Path(directory)
    files = {
        path.relative_to(directory).as_posix(): [file_checksum(path)]
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != CHECKSUMS_FNAME
    }
    write_checksums(directory, files)
    fsync_path(directory)


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
    """A checkpoint's files do not match their checksums, or a file's fields are malformed."""

    def __init__(self, checkpoint_dir: str | Path, corruptions: list[Corruption]) -> None:
        self.corruptions = corruptions
        shown = "\n  ".join(map(str, corruptions[:20]))
        more = f"\n  ... (+{len(corruptions) - 20} more)" if len(corruptions) > 20 else ""
        super().__init__(
            f"Checkpoint {checkpoint_dir} is corrupt:\n  {shown}{more}\n"
            "Nothing of it was used; `python -m nemo_ckpt verify` checks every file"
        )


class MissingChecksumsError(CheckpointingException):
    """A checkpoint our writer saved with checksums has lost its checksums file."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__(
            f"{directory} was saved with checksums, but {Path(directory) / CHECKSUMS_FNAME} is missing (deleted, or "
            "not copied with the checkpoint), so its files cannot be verified. Restore the file, or load the "
            "checkpoint unverified with verify=False (MegatronStrategy(ckpt_verify_on_load=False))"
        )


def safe_relative_path(directory: str | Path, name: object, what: str) -> Path:
    """`directory / name` for a `name` that stays inside `directory`: relative, without `..`, and not leading out of
    it through a symbolic link; else `CorruptCheckpointError` naming `what` (the file that holds `name`)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptCheckpointError(directory, [Corruption(what, 0, 0, f"invalid file name {name!r}")])
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
        raise CorruptCheckpointError(
            directory, [Corruption(what, 0, 0, f"file name {name!r} points outside the checkpoint directory")]
        )
    path = Path(directory) / name
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise CorruptCheckpointError(
            directory, [Corruption(what, 0, 0, f"{name!r} is a symbolic link that leads outside the checkpoint")]
        )
    return path


@dataclass(frozen=True)
class Checksums:
    """The stored checksums of one directory."""

    directory: Path
    files: dict[str, list[list[int]]]

    def ranges(self, name: str) -> list[list[int]]:
        """`name`'s ranges; a file the checksums do not list is corrupt (our writer lists every file it reads)."""
        if name not in self.files:
            raise CorruptCheckpointError(
                self.directory, [Corruption(name, 0, 0, f"the file has no checksum in {CHECKSUMS_FNAME}")]
            )
        return self.files[name]

    def check_file(self, name: str, data: bytes) -> None:
        """Raise `CorruptCheckpointError` unless `data`, the whole content read from `name`, matches its checksums."""
        verifier = FileVerifier(self.directory, name, self.ranges(name))
        verifier.add_bytes(0, data)
        corruptions = verifier.corruptions(None, whole_file=len(data))
        if corruptions:
            raise CorruptCheckpointError(self.directory, corruptions)

    def verifier(self, name: str) -> FileVerifier:
        """A `FileVerifier` of the file `name`."""
        return FileVerifier(self.directory, name, self.ranges(name))


def _malformed(directory: Path, reason: str) -> CorruptCheckpointError:
    size = (directory / CHECKSUMS_FNAME).stat().st_size
    return CorruptCheckpointError(directory, [Corruption(CHECKSUMS_FNAME, 0, size, reason)])


def _parse_ranges(directory: Path, name: str, ranges: object) -> list[list[int]]:
    safe_relative_path(directory, name, CHECKSUMS_FNAME)
    if not isinstance(ranges, list):
        raise _malformed(directory, f"ranges of {name!r} are not a list")
    end = 0
    for item in ranges:
        valid = isinstance(item, list) and len(item) == 3 and all(type(v) is int for v in item)
        if not valid or item[0] < end or item[1] < 0 or not 0 <= item[2] < 1 << 32:
            raise _malformed(directory, f"malformed or overlapping range {item!r} of {name!r}")
        end = item[0] + item[1]
    return ranges


@functools.lru_cache(maxsize=8)
def _parse_document(directory: Path, raw: bytes) -> Checksums:
    """`raw` (the content of `directory`'s checksums file) parsed and checked; cached: a load reads it several
    times."""
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise _malformed(directory, f"not JSON: {e}") from e
    if not isinstance(document, dict) or not set(document) <= _DOCUMENT_KEYS or "files" not in document:
        raise _malformed(directory, "not a checksums document")
    if document.get("algorithm") != ALGORITHM:
        raise _malformed(directory, f"unknown algorithm {document.get('algorithm')!r}")
    files = document["files"]
    if not isinstance(files, dict):
        raise _malformed(directory, "'files' is not a mapping")
    if "crc32c" in document and document["crc32c"] != _files_crc(files):  # absent: saved before it was stored
        raise _malformed(directory, "its own checksum does not match: the checksums file is damaged")
    return Checksums(directory, {name: _parse_ranges(directory, name, r) for name, r in files.items()})


def _read_document(directory: Path) -> Checksums:
    return _parse_document(directory, (directory / CHECKSUMS_FNAME).read_bytes())


def read_checksums(directory: str | Path) -> Checksums | None:
    """The stored checksums of `directory`, or None where it has none."""
    directory = Path(directory)
    if not (directory / CHECKSUMS_FNAME).is_file():
        return None
    return _read_document(directory)


def written_with_checksums(checkpoint_dir: str | Path) -> bool:
    """Whether our writer saved `checkpoint_dir` with checksums (its `.metadata` holds `CHECKSUMS_MARKER`)."""
    try:
        stat = (Path(checkpoint_dir) / DCP_METADATA_FNAME).stat()
    except OSError:
        return False
    return _holds_marker(Path(checkpoint_dir) / DCP_METADATA_FNAME, (stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _holds_marker(path: Path, version: tuple[int, int, int]) -> bool:
    """Whether `path` (at `version`: a load asks several times) holds the marker."""
    try:
        with open(path, "rb") as f:
            return CHECKSUMS_MARKER.encode() in f.read()
    except OSError:
        return False


def expected_checksums(
    checkpoint_dir: str | Path, verify: bool = True, required: bool | None = None
) -> Checksums | None:
    """The checksums a load of `checkpoint_dir` checks (None: verification off, or a checkpoint saved without
    them); raises `MissingChecksumsError` if it has none but needs them: `required`, by default where our writer
    marked it (a training checkpoint's `context/` needs them where its `weights/` is marked)."""
    if not verify:
        return None
    checksums = read_checksums(checkpoint_dir)
    if checksums is None and (written_with_checksums(checkpoint_dir) if required is None else required):
        raise MissingChecksumsError(checkpoint_dir)
    return checksums


def read_verified(checkpoint_dir: str | Path, name: str, verify: bool = True, required: bool | None = None) -> bytes:
    """The content of the small file `name` of `checkpoint_dir`, checked against its checksum (if it has one, see
    `expected_checksums`)."""
    data = (Path(checkpoint_dir) / name).read_bytes()
    checksums = expected_checksums(checkpoint_dir, verify, required)
    if checksums is not None:
        checksums.check_file(name, data)
    return data


class FileVerifier:
    """Checks the bytes that a load reads from one file against the file's checksum ranges.

    Reads register what they read: `add_read` (from the reading thread, right after its read: the CRC32C of those
    bytes only) or `add_bytes` (bytes kept in memory, e.g. the ends of a `torch.save` zip); `require` marks bytes
    used without being read here (the zip's records that were parsed). `corruptions` then checks every range that
    holds a used byte: from the CRCs of the reads inside it, combined, and the bytes kept, reading only what no
    read covered (the rest of a range that a load read part of).
    """

    def __init__(self, directory: Path, name: str, ranges: list[list[int]]) -> None:
        self.directory, self.name, self.ranges = directory, name, ranges
        self.starts = [offset for offset, _, _ in ranges]
        self._reads: list[tuple[int, int, int]] = []  # (start, end, crc)
        self._kept: list[tuple[int, bytes | memoryview]] = []
        self._used: list[tuple[int, int]] = []
        self._checked: set[int] = set()
        self._lock = threading.Lock()

    def next_boundary(self, position: int) -> int | None:
        """The first range start after `position` (reads are split there), or None."""
        index = bisect.bisect_right(self.starts, position)
        return self.starts[index] if index < len(self.starts) else None

    def add_read(self, start: int, data: memoryview) -> None:
        """Register bytes just read at `start` (called by the thread that read them)."""
        crc = extend(0, data)
        with self._lock:
            self._reads.append((start, start + data.nbytes, crc))

    def add_bytes(self, start: int, data: bytes | memoryview, used: bool = True) -> None:
        """Register bytes read at `start` and kept in memory (`used`: all of them are used; else `require` says
        which)."""
        with self._lock:
            self._kept.append((start, data))
            if used:
                self._used.append((start, start + len(data)))

    def require(self, start: int, end: int) -> None:
        """Register bytes used without being read through this verifier."""
        with self._lock:
            self._used.append((start, end))

    def _touched(self, intervals: list[tuple[int, int]]) -> list[int]:
        indices = set()
        for start, end in intervals:
            index = max(0, bisect.bisect_right(self.starts, start) - 1)
            while index < len(self.ranges) and self.ranges[index][0] < end:
                if self.ranges[index][0] + self.ranges[index][1] > start:
                    indices.add(index)
                index += 1
        return sorted(indices)

    @staticmethod
    def _kept_slice(kept: list[tuple[int, bytes | memoryview]], start: int, end: int) -> memoryview | None:
        index = bisect.bisect_right(kept, start, key=lambda piece: piece[0])
        for offset, data in kept[max(0, index - 2) : index]:
            if end <= offset + len(data):
                return memoryview(data)[start - offset : end - offset]
        return None

    def _gap_crc(self, fd: int | None, kept: list[tuple[int, bytes | memoryview]], start: int, end: int) -> int:
        data = self._kept_slice(kept, start, end)
        if data is not None:
            return extend(0, data)
        crc, position = 0, start
        while position < end:
            block = os.pread(fd, min(READ_BLOCK, end - position), position) if fd is not None else b""
            if not block:
                raise CorruptCheckpointError(
                    self.directory, [Corruption(self.name, position, end, "truncated: the file ends before them")]
                )
            crc = extend(crc, block)
            position += len(block)
        return crc

    def _range_crc(self, fd: int | None, reads: list, kept: list, offset: int, length: int) -> int:
        end = offset + length
        data = self._kept_slice(kept, offset, end)
        if data is not None:
            return extend(0, data)
        crc, position = 0, offset
        index = bisect.bisect_left(reads, (offset,))
        while index < len(reads) and reads[index][0] < end:
            start, stop, read_crc = reads[index]
            index += 1
            if start < position or stop > end:  # overlaps a read used already, or crosses the range's end
                continue
            if start > position:
                crc = crc32c_combine(crc, self._gap_crc(fd, kept, position, start), start - position)
            crc = crc32c_combine(crc, read_crc, stop - start)
            position = stop
        if position < end:
            crc = crc32c_combine(crc, self._gap_crc(fd, kept, position, end), end - position)
        return crc

    def corruptions(self, fd: int | None, whole_file: int | None = None) -> list[Corruption]:
        """The corrupt ranges among those holding a registered byte not checked yet (`fd`: to read what no read
        covered; None: nothing more can be read). `whole_file`: the file's size; every range is checked."""
        with self._lock:
            reads, kept = sorted(self._reads), sorted(self._kept, key=lambda piece: piece[0])
            used = self._used + [(start, end) for start, end, _ in reads]
        indices = range(len(self.ranges)) if whole_file is not None else self._touched(used)
        found = []
        written = self.ranges[-1][0] + self.ranges[-1][1] if self.ranges else 0
        if whole_file is not None and whole_file != written:
            reason = f"the file has {whole_file} bytes, {written} were written"
            found.append(Corruption(self.name, min(written, whole_file), max(written, whole_file), reason))
        for index in indices:
            offset, length, expected = self.ranges[index]
            if index in self._checked or (whole_file is not None and offset + length > whole_file):
                continue
            try:
                actual = self._range_crc(fd, reads, kept, offset, length)
            except CorruptCheckpointError as error:
                found += error.corruptions
                continue
            if actual != expected:
                reason = f"checksum mismatch (stored {expected:08x}, read {actual:08x})"
                found.append(Corruption(self.name, offset, offset + length, reason))
            self._checked.add(index)
        return found

    def check(self, fd: int | None) -> None:
        """Raise `CorruptCheckpointError` if a range holding a registered byte is corrupt."""
        found = self.corruptions(fd)
        if found:
            raise CorruptCheckpointError(self.directory, found)


def _verify_file(checkpoint_dir: Path, name: str, ranges: list[list[int]]) -> list[Corruption]:
    try:
        path = safe_relative_path(checkpoint_dir, name, CHECKSUMS_FNAME)
    except CorruptCheckpointError as error:
        return error.corruptions
    if not path.is_file():
        return [Corruption(name, 0, max((o + n for o, n, _ in ranges), default=0), "file is missing")]
    size = path.stat().st_size
    verifier = FileVerifier(checkpoint_dir, name, ranges)
    with open(path, "rb") as f:
        return verifier.corruptions(f.fileno(), whole_file=size)


def check_directory(directory: str | Path) -> None:
    """Raise unless `directory` exists and is a directory (naming a missing path, a file or a symlink loop)."""
    try:
        os.stat(directory)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointingException(f"{directory} is a symbolic link loop") from e
        if os.path.islink(directory):
            raise CheckpointingException(f"{directory} is a symbolic link to a missing path") from e
        raise CheckpointingException(f"{directory} does not exist") from e
    if not os.path.isdir(directory):
        raise CheckpointingException(f"{directory} is not a checkpoint directory: it is a file")


def verify_checkpoint(
    checkpoint_dir: str | Path,
    threads: int = 4,
    progress: Callable[[int, int, str], None] | None = None,
    required: bool | None = None,
) -> list[Corruption] | None:
    """Check every stored checksum of `checkpoint_dir` (files in parallel); return the corruptions found (empty:
    intact), or None if it has no checksums. Raises if it is missing or not a directory, and
    `MissingChecksumsError` if it has none but needs them: `required`, by default where our writer marked it.
    `progress(done, total, file)` after each file."""
    checkpoint_dir = Path(checkpoint_dir)
    check_directory(checkpoint_dir)
    try:
        checksums = read_checksums(checkpoint_dir)
    except CorruptCheckpointError as error:
        return error.corruptions
    if checksums is None:
        if written_with_checksums(checkpoint_dir) if required is None else required:
            raise MissingChecksumsError(checkpoint_dir)
        return None
    corruptions: list[Corruption] = []
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-verify") as pool:
        futures = {
            name: pool.submit(_verify_file, checkpoint_dir, name, ranges) for name, ranges in checksums.files.items()
        }
        for done, (name, future) in enumerate(futures.items(), 1):
            corruptions += future.result()
            if progress is not None:
                progress(done, len(futures), name)
    return corruptions


def raise_if_corrupt(directory: str | Path, required: bool | None = None) -> None:
    """Raise `CorruptCheckpointError` naming every corrupt range of `directory` (one without checksums passes
    unless `required`, see `verify_checkpoint`)."""
    corruptions = verify_checkpoint(directory, required=required)
    if corruptions:
        raise CorruptCheckpointError(directory, corruptions)


def print_progress(done: int, total: int, name: str) -> None:
    """A `progress` callback for the command line: one line per file on stderr."""
    print(f"[{done}/{total}] {name}", file=sys.stderr)

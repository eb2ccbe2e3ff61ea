"""The disk's ceiling: the fastest this machine writes bytes durably and reads them back cold.

    python benchmarks/disk_ceiling.py [--size-gib 1] [--reps 3] [--dir /tmp/disk_ceiling]

Writes: `dd bs=1M conv=fdatasync` in 1, 2, 4 and 8 parallel streams (the bytes split evenly over the
streams, one file each) and `dd oflag=direct` (O_DIRECT, 8 MiB blocks, no page cache) in 1 and 4 streams, all
copying pseudo-random bytes from a file in memory (`source_file`, on tmpfs), not `/dev/zero`: a virtual disk may
skip blocks of zeros (on our VM, zeros wrote 10-25% faster and read back 20% faster than other bytes), and no
checkpoint is all zeros. Reads: the files of the 8-stream write, read back cold (page cache dropped, when root)
by `dd` into /dev/null in 1, 2, 4 and 8 parallel streams (each stream reads its share of the files one after
another), and with `iflag=direct` in 4 streams. The ceiling is the best median over the variants; a single
buffered stream (`dd x1`, the old baseline) is one of them.
`ckpt_bench.py` runs the same variants as contestants, interleaved with the checkpoint libraries, on every
rank at once (each rank its share of the bytes), and quotes every save and load against this ceiling.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from results import check_dependencies

MIB = 1 << 20
DIRECT_BLOCK_MIB = 8
STREAMS = (1, 2, 4, 8)
DIRECT_STREAMS = (1, 4)
DIRECT_READ_STREAMS = 4
SOURCE_BLOCK = 64 * MIB
SOURCE_BYTES = 1024 * MIB  # the most memory the written bytes' source takes
READ_SOURCE = "dd x8"


def write_variants() -> dict[str, tuple[int, bool]]:
    """Name -> (parallel streams, O_DIRECT)."""
    variants = {f"dd x{n}": (n, False) for n in STREAMS}
    variants.update({f"O_DIRECT x{n}": (n, True) for n in DIRECT_STREAMS})
    return variants


def read_variants() -> dict[str, tuple[int, bool]]:
    """Name -> (parallel streams, O_DIRECT); every read reads the files of the `READ_SOURCE` write."""
    variants = {f"read x{n}": (n, False) for n in STREAMS}
    variants[f"O_DIRECT read x{DIRECT_READ_STREAMS}"] = (DIRECT_READ_STREAMS, True)
    return variants


def stream_files(directory: Path, streams: int, prefix: str = "") -> list[Path]:
    """The files a write of `streams` streams creates in `directory`."""
    return [directory / f"{prefix}x{streams}_{i}" for i in range(streams)]


def start(commands: list[list[str]], idle: bool = False) -> list[subprocess.Popen]:
    """Start `commands` in parallel; with `idle`, at the lowest CPU priority (`SCHED_IDLE`)."""
    preexec = (lambda: os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))) if idle else None
    return [subprocess.Popen(command, preexec_fn=preexec) for command in commands]


def wait(processes: list[subprocess.Popen]) -> None:
    """Wait for `processes` (from `start`); raise if any failed."""
    codes = [process.wait() for process in processes]
    if any(codes):
        failed = processes[next(i for i, code in enumerate(codes) if code)]
        raise RuntimeError(f"dd failed ({codes}): {failed.args}")


def source_file(nbytes: int) -> Path:
    """A new file of min(`nbytes`, `SOURCE_BYTES`) pseudo-random bytes (a random 64 MiB block repeated) in memory:
    on tmpfs (`/dev/shm`) where there is one. The caller removes it."""
    shm = Path("/dev/shm")
    fd, name = tempfile.mkstemp(prefix="disk_ceiling_source_", dir=shm if shm.is_dir() else None)
    nbytes = min(nbytes, SOURCE_BYTES)
    block = os.urandom(min(nbytes, SOURCE_BLOCK))
    with os.fdopen(fd, "wb") as stream:
        for start in range(0, nbytes, len(block)):
            stream.write(block[: nbytes - start])
    return Path(name)


def write_commands(
    directory: Path, source: Path, nbytes: int, streams: int, direct: bool = False, prefix: str = ""
) -> list[list[str]]:
    """Commands writing `nbytes` durably in `streams` parallel `dd` processes (O_DIRECT with `direct`), each its
    share of the bytes, as copies of `source` one after another (one `dd` each, the last one syncing the file)."""
    block = (DIRECT_BLOCK_MIB if direct else 1) * MIB
    count = max(1, nbytes // streams // block)
    per_copy = max(1, source.stat().st_size // block)
    flags = "oflag=direct" if direct else ""
    chains = []
    for path in stream_files(directory, streams, f"{prefix}direct_" if direct else prefix):
        copies = [
            f"dd if='{source}' of='{path}' bs={block} seek={start} count={min(per_copy, count - start)} {flags}"
            f" conv=notrunc{',fdatasync' if start + per_copy >= count else ''} status=none"
            for start in range(0, count, per_copy)
        ]
        chains.append(["sh", "-c", " && ".join(copies)])
    return chains


def write(directory: Path, source: Path, nbytes: int, streams: int, direct: bool = False, prefix: str = "") -> None:
    """Write `nbytes` durably as `write_commands` says, and wait."""
    wait(start(write_commands(directory, source, nbytes, streams, direct, prefix)))


def read(files: list[Path], streams: int, direct: bool = False) -> None:
    """Read `files` into /dev/null in `streams` parallel `dd` chains (O_DIRECT with `direct`)."""
    flags = f"iflag=direct bs={DIRECT_BLOCK_MIB}M" if direct else "bs=4M"
    chains = [files[i::streams] for i in range(min(streams, len(files)))]
    commands = [
        ["sh", "-c", " && ".join(f"dd if='{path}' of=/dev/null {flags} status=none" for path in chain)]
        for chain in chains
    ]
    wait(start(commands))


def drop_caches() -> None:
    """Write back and drop the page cache (root only; a no-op otherwise)."""
    if os.geteuid() == 0:
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)


def best(medians: dict[str, float]) -> tuple[str, float]:
    """The fastest variant and its median seconds."""
    name = min(medians, key=medians.get)
    return name, medians[name]


def measure(
    directory: Path, source: Path, nbytes: int, reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds of every write (of `source`'s bytes) and read variant, `reps` times each, variants interleaved
    (rotated order)."""
    directory.mkdir(parents=True, exist_ok=True)
    writes, reads = write_variants(), read_variants()
    write_times: dict[str, list[float]] = {name: [] for name in writes}
    read_times: dict[str, list[float]] = {name: [] for name in reads}
    for rep in range(reps):
        names = list(writes)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            streams, direct = writes[name]
            for path in stream_files(directory, streams, "direct_" if direct else ""):
                path.unlink(missing_ok=True)
            drop_caches()
            start = time.perf_counter()
            write(directory, source, nbytes, streams, direct)
            write_times[name].append(time.perf_counter() - start)
        names = list(reads)
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            streams, direct = reads[name]
            drop_caches()
            start = time.perf_counter()
            read(stream_files(directory, write_variants()[READ_SOURCE][0]), streams, direct)
            read_times[name].append(time.perf_counter() - start)
    return write_times, read_times


def main() -> None:
    check_dependencies([], programs=["dd"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/disk_ceiling"))
    args = parser.parse_args()
    nbytes = int(args.size_gib * (1 << 30))
    source = source_file(nbytes)
    try:
        write_times, read_times = measure(args.dir, source, nbytes, args.reps)
    finally:
        source.unlink()
        shutil.rmtree(args.dir, ignore_errors=True)
    for kind, times in (("write", write_times), ("read", read_times)):
        medians = {name: statistics.median(values) for name, values in times.items()}
        for name, median in medians.items():
            print(f"{kind} {name}: {median:.3f} s median, {nbytes / median / (1 << 30):.2f} GiB/s")
        name, median = best(medians)
        speed = nbytes / median / (1 << 30)
        print(f"{kind} ceiling: {name}, {median:.3f} s for {args.size_gib} GiB ({speed:.2f} GiB/s)")


if __name__ == "__main__":
    main()

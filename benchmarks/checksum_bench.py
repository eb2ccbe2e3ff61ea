"""The cost of the CRC32C checksums (`integrity.py`): computed by the writer threads at save, checked as a load
reads the bytes.

    python benchmarks/checksum_bench.py [--size-mib 512] [--reps 9] [--parts save load] [--dir /tmp/checksum_bench]

One process, a state of `--size-mib` float32 data (64 MiB tensors).

`save`: saved with the torch_dist strategy as `DistCheckpointIO` configures it (2 writer threads, no zip CRC-32s),
with and without checksums, alternating which goes first in each repetition; each save is fsynced. Two conditions,
interleaved: `steady` saves one after another as training does (the previous save's pages still cached), `cold`
saves after the page cache was written back and dropped (as root; on a VM that hands free memory back to its host,
each save then faults its page cache in anew). Prints, per condition, the median save times (wall, and CPU seconds
of the process: the checksums' own cost, which disk noise does not blur), their ratios, and the median time of
`verify_checkpoint`.

`load`: one checkpoint saved with checksums, loaded into the state's tensors as a resume does (the fast reader, 2
files at a time) with verification (the default: each read's CRC32C computed by the thread that read it) and
without (`verify=False`), and the disk's read ceiling measured in the same run (`disk_ceiling.py`'s `dd` reads of
as many bytes, 1-8 streams, and O_DIRECT), in a shuffled order each repetition. Two conditions: `cold` (page cache
dropped before each, as root: what a resume reads) and `warm` (the checkpoint's pages cached, the ceiling not run:
the checks' CPU cost with no disk wait to hide it). Prints per condition the median times (wall, CPU), the verified
load's ratio to the unverified one (ratio of medians, and median of the per-repetition ratios), and each as a
fraction of the ceiling's speed (`ceiling time / time`).
"""

import argparse
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import disk_ceiling  # noqa: E402
from results import check_dependencies  # noqa: E402

from nemo_ckpt import dist_checkpointing as dc  # noqa: E402
from nemo_ckpt.dist_checkpointing.integrity import verify_checkpoint  # noqa: E402
from nemo_ckpt.dist_checkpointing.strategies.torch import (  # noqa: E402
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

CONDITIONS = ("steady", "cold")
LOAD_CONDITIONS = ("cold", "warm")
VERIFIED, UNVERIFIED = "load, verified", "load, unverified"


def make_state(size_mib: int) -> dict:
    tensors = max(1, size_mib // 64)
    numel = 16 * 2**20 * size_mib // (64 * tensors)
    return {f"t{i}": dc.ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(numel)) for i in range(tensors)}


def save_seconds(state: dict, directory: Path, checksums: bool, cold: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one save."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    if cold:
        disk_ceiling.drop_caches()
    strategy = TorchDistSaveShardedStrategy(thread_count=2, crc32=False, checksums=checksums)
    start, cpu = time.perf_counter(), time.process_time()
    dc.save(state, directory, strategy, validate_access_integrity=False)
    return time.perf_counter() - start, time.process_time() - cpu


def run_saves(state: dict, root: Path, size_mib: int, reps: int) -> None:
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    verify_times = []
    for rep in range(reps):
        for condition in CONDITIONS:
            for checksums in (True, False) if rep % 2 == 0 else (False, True):
                seconds = save_seconds(state, root / str(checksums), checksums, cold=condition == "cold")
                times.setdefault((condition, checksums), []).append(seconds)
        start = time.perf_counter()
        assert verify_checkpoint(root / "True") == []
        verify_times.append(time.perf_counter() - start)
        for path in (root / "False").iterdir():  # the same page cache state for both: verify read the other
            path.read_bytes()
    print(f"save: {size_mib} MiB, {reps} reps, medians")
    for condition in CONDITIONS:
        (wall_with, cpu_with), (wall_without, cpu_without) = (
            [statistics.median(column) for column in zip(*times[condition, checksums])] for checksums in (True, False)
        )
        print(
            f"{condition}: save {wall_without:.3f} s without checksums, {wall_with:.3f} s with "
            f"(x{wall_with / wall_without:.3f}); CPU {cpu_without:.3f} s without, {cpu_with:.3f} s with "
            f"(x{cpu_with / cpu_without:.3f})"
        )
    print(f"verify (page cache warm): {statistics.median(verify_times):.3f} s")


def timed(run: Callable[[], None], cold: bool) -> tuple[float, float]:
    """Wall and CPU seconds of `run()`, after dropping the page cache if `cold`."""
    if cold:
        disk_ceiling.drop_caches()
    start, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - start, time.process_time() - cpu


def run_loads(state: dict, root: Path, size_mib: int, reps: int) -> None:
    checkpoint, ceiling = root / "load", root / "ceiling"
    save_seconds(state, checkpoint, checksums=True, cold=False)
    nbytes = size_mib << 20
    source = disk_ceiling.source_file(nbytes)
    try:
        ceiling.mkdir(parents=True)
        streams = disk_ceiling.write_variants()[disk_ceiling.READ_SOURCE][0]
        disk_ceiling.write(ceiling, source, nbytes, streams)
    finally:
        source.unlink()
    ceiling_files = disk_ceiling.stream_files(ceiling, streams)

    def load(verify: bool) -> Callable[[], None]:
        strategy = TorchDistLoadShardedStrategy(thread_count=2)
        return lambda: dc.load(state, checkpoint, strategy, validate_access_integrity=False, verify=verify)

    contestants: dict[str, Callable[[], None]] = {VERIFIED: load(True), UNVERIFIED: load(False)}
    for name, (read_streams, direct) in disk_ceiling.read_variants().items():
        contestants[name] = lambda s=read_streams, d=direct: disk_ceiling.read(ceiling_files, s, d)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rep in range(reps):
        for condition in LOAD_CONDITIONS:
            names = [name for name in contestants if condition == "cold" or name in (VERIFIED, UNVERIFIED)]
            random.Random(rep * 2 + (condition == "warm")).shuffle(names)
            if condition == "warm":
                load(False)()  # the checkpoint's pages in the page cache
            for name in names:
                times.setdefault((condition, name), []).append(timed(contestants[name], cold=condition == "cold"))
    print(f"load: {size_mib} MiB, {reps} reps, medians, contestants shuffled each repetition")
    for condition in LOAD_CONDITIONS:
        wall = {name: statistics.median(t for t, _ in runs) for (c, name), runs in times.items() if c == condition}
        cpu = {name: statistics.median(t for _, t in runs) for (c, name), runs in times.items() if c == condition}
        reads = {name: seconds for name, seconds in wall.items() if name not in (VERIFIED, UNVERIFIED)}
        best_name, best = disk_ceiling.best(reads) if reads else ("", 0.0)
        paired = [v[0] / u[0] for v, u in zip(times[condition, VERIFIED], times[condition, UNVERIFIED])]
        print(
            f"{condition}: verified {wall[VERIFIED]:.3f} s (CPU {cpu[VERIFIED]:.3f} s), unverified "
            f"{wall[UNVERIFIED]:.3f} s (CPU {cpu[UNVERIFIED]:.3f} s): x{wall[VERIFIED] / wall[UNVERIFIED]:.3f} "
            f"(median of per-repetition ratios x{statistics.median(paired):.3f})"
        )
        for name, seconds in sorted(wall.items(), key=lambda item: item[1]):
            fraction = f", {best / seconds:.2f} of the ceiling ({best_name})" if reads else ""
            print(f"  {name}: {seconds:.3f} s{fraction}")


def main() -> None:
    check_dependencies(["crc32c"], programs=["dd"])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--parts", nargs="+", choices=["save", "load"], default=["save", "load"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/checksum_bench"))
    args = parser.parse_args()
    state = make_state(args.size_mib)
    try:
        if "save" in args.parts:
            run_saves(state, args.dir, args.size_mib, args.reps)
        if "load" in args.parts:
            run_loads(state, args.dir, args.size_mib, args.reps)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

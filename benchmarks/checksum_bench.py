"""Save-time overhead of the CRC32C checksums computed by the writer threads (`integrity.py`).

    python benchmarks/checksum_bench.py [--size-mib 512] [--reps 7] [--dir /tmp/checksum_bench]

One process saves a state of `--size-mib` float32 data (64 MiB tensors) with the torch_dist strategy as
`DistCheckpointIO` configures it (2 writer threads, no zip CRC-32s), with and without checksums, alternating
which goes first in each repetition; each save is fsynced. Two conditions, interleaved: `steady` saves one after
another as training does (the previous save's pages still cached), `cold` saves after the page cache was written
back and dropped (as root; on a VM that hands free memory back to its host, each save then faults its page
cache in anew). Prints, per condition, the median save times (wall, and CPU seconds of the process: the
checksums' own cost, which disk noise does not blur), their ratios, and the median time of `verify_checkpoint`.
"""

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import disk_ceiling  # noqa: E402
from results import check_dependencies  # noqa: E402

from nemo_ckpt import dist_checkpointing as dc  # noqa: E402
from nemo_ckpt.dist_checkpointing.integrity import verify_checkpoint  # noqa: E402
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy  # noqa: E402

CONDITIONS = ("steady", "cold")


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


def main() -> None:
    check_dependencies(["crc32c"])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/checksum_bench"))
    args = parser.parse_args()
    tensors = max(1, args.size_mib // 64)
    state = {
        f"t{i}": dc.ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(16 * 2**20 * args.size_mib // (64 * tensors)))
        for i in range(tensors)
    }
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    verify_times = []
    for rep in range(args.reps):
        for condition in CONDITIONS:
            for checksums in (True, False) if rep % 2 == 0 else (False, True):
                seconds = save_seconds(state, args.dir / str(checksums), checksums, cold=condition == "cold")
                times.setdefault((condition, checksums), []).append(seconds)
        start = time.perf_counter()
        assert verify_checkpoint(args.dir / "True") == []
        verify_times.append(time.perf_counter() - start)
        for path in (args.dir / "False").iterdir():  # the same page cache state for both: verify read the other
            path.read_bytes()
    print(f"{args.size_mib} MiB, {args.reps} reps, medians")
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
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

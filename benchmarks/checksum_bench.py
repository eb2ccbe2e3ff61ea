"""Save-time overhead of the CRC32C checksums computed by the writer threads (`integrity.py`).

    python benchmarks/checksum_bench.py [--size-mib 512] [--reps 7] [--dir /tmp/checksum_bench]

One process saves a state of `--size-mib` float32 data (64 MiB tensors) with the torch_dist strategy as
`DistCheckpointIO` configures it (2 writer threads, no zip CRC-32s), with and without checksums, alternating
which goes first in each repetition; each save is fsynced. Prints the median save times, their ratio, and the
median time of `verify_checkpoint` on the result.
"""

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import check_dependencies  # noqa: E402

from nemo_ckpt import dist_checkpointing as dc  # noqa: E402
from nemo_ckpt.dist_checkpointing.integrity import verify_checkpoint  # noqa: E402
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy  # noqa: E402


def save_seconds(state: dict, directory: Path, checksums: bool) -> float:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    strategy = TorchDistSaveShardedStrategy(thread_count=2, crc32=False, checksums=checksums)
    start = time.perf_counter()
    dc.save(state, directory, strategy, validate_access_integrity=False)
    return time.perf_counter() - start


def main() -> None:
    check_dependencies(["crc32c"])
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/checksum_bench"))
    args = parser.parse_args()
    tensors = max(1, args.size_mib // 64)
    state = {
        f"t{i}": dc.ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(16 * 2**20 * args.size_mib // (64 * tensors)))
        for i in range(tensors)
    }
    times: dict[bool, list[float]] = {True: [], False: []}
    verify_times = []
    for rep in range(args.reps):
        for checksums in (True, False) if rep % 2 == 0 else (False, True):
            times[checksums].append(save_seconds(state, args.dir / str(checksums), checksums))
        start = time.perf_counter()
        assert verify_checkpoint(args.dir / "True") == []
        verify_times.append(time.perf_counter() - start)
    with_sums, without = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{args.size_mib} MiB, {args.reps} reps, median save: {without:.3f} s without checksums, {with_sums:.3f} s with"
    )
    print(f"overhead ratio (with / without): {with_sums / without:.3f}")
    print(f"verify (page cache warm): {statistics.median(verify_times):.3f} s")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Checkpoint save/load speed against the disk (dd), torch.save, plain DCP and megatron-core.

    python benchmarks/ckpt_bench.py [--sizes-gib 1 4] [--ranks 2 1] [--reps 5] [--dir /tmp/ckpt_bench]

The state is a list of 64 MiB float32 tensors, each split along dim 0 over the ranks (as FSDP or tensor
parallelism shards them): a rank holds size / ranks bytes. Per repetition every contestant runs once, in
an order shuffled each repetition (the same on every rank). Every save and load starts with the page cache
dropped (when root): this VM gives free page-cache memory back to its host, so without that a write is fast
or slow depending on what ran before it. Times are the slowest rank's, between two barriers; a save's time
does not include removing the previous repetition's files.
The 1-rank run also loads the 2-rank checkpoints (a reshard). megatron-core is used when importable
(e.g. PYTHONPATH=/tmp/mcore-site); its CUDA calls are made no-ops on CPU.
Writes `## Checkpoint speed` in benchmarks/RESULTS.md and benchmarks/ckpt_speed.png. Needs about 10x the
largest size of free disk under --dir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from results import MEGATRON_CORE_INSTALL, check_dependencies, write_section  # noqa: E402

from nemo_ckpt import dist_checkpointing as dc  # noqa: E402
from nemo_ckpt.dist_checkpointing.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from nemo_ckpt.dist_checkpointing.strategies.fully_parallel import (  # noqa: E402
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from nemo_ckpt.dist_checkpointing.strategies.torch import (  # noqa: E402
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from tests.helpers.distributed import free_port  # noqa: E402

TENSOR_BYTES = 64 << 20
ROW = 4096  # float32 values per row
SECTION = "## Checkpoint speed"
SAVE_DIRS = {
    "dd": "dd",
    "torch.save": "torch_save",
    "dcp": "dcp",
    "ours": "ours",
    "ours async": "ours_async",
    "megatron-core": "mcore",
}
RESHARD_SOURCES = {"dd", "dcp", "ours", "mcore"}  # the 2-rank saves that the 1-rank run loads


def megatron_dist_checkpointing():
    """megatron-core's dist_checkpointing, or None when it is not installed."""
    try:
        if not torch.cuda.is_available():
            torch.cuda.synchronize = lambda *args, **kwargs: None
            torch.cuda.current_device = lambda: "cpu"
        from megatron.core import dist_checkpointing
    except ImportError:
        return None
    return dist_checkpointing


def local_state(size: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    rows = TENSOR_BYTES // 4 // ROW
    count = size // TENSOR_BYTES
    return {f"t{i}": torch.full((rows // world, ROW), float(i + rank), dtype=torch.float32) for i in range(count)}


def config_dir(size: int, world: int) -> str:
    return f"{size >> 20}mib_{world}r"


def drop_caches() -> None:
    """Write back and drop the page cache (root only), on rank 0, then barrier."""
    if dist.get_rank() == 0 and os.geteuid() == 0:
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
    dist.barrier()


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes on the slowest rank, between barriers."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


class Contestants:
    """Each contestant's save and load on this rank, writing under ``root``."""

    def __init__(self, root: Path, size: int, rank: int, world: int) -> None:
        self.root, self.rank, self.world = root, rank, world
        self.state = local_state(size, rank, world)
        self.targets = {key: torch.zeros_like(t) for key, t in self.state.items()}
        self.rows = next(iter(self.state.values())).shape[0]
        self.mcore = megatron_dist_checkpointing()
        self.queue = AsyncCallsQueue()
        self.blocked = 0.0
        self.mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        self.ours_sync = self.ours_save_strategy()
        self.ours_async = self.ours_save_strategy()
        self.validated: set[str] = set()

    def clear(self, contestant: str) -> None:
        """An empty directory for ``contestant``'s save."""
        if contestant in SAVE_DIRS and self.rank == 0:
            path = self.root / SAVE_DIRS[contestant]
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        dist.barrier()

    def path(self, contestant: str) -> Path:
        return self.root / SAVE_DIRS[contestant]

    def sharded(self, lib, template: bool = False) -> dict:
        return {
            key: lib.ShardedTensor.from_rank_offsets(
                key, self.targets[key] if template else t, (0, self.rank, self.world)
            )
            for key, t in self.state.items()
        }

    def dtensors(self, template: bool = False) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        return {
            key: DTensor.from_local(self.targets[key] if template else t, self.mesh, [Shard(0)], run_check=False)
            for key, t in self.state.items()
        }

    def ours_save_strategy(self) -> FullyParallelSaveStrategyWrapper:
        """The spec's best practice (parallel save, 2 writers per rank, constant structure), as DistCheckpointIO
        saves with those options: without the zip CRCs, which no loader checks, and (async) staging into the
        CPU buffers of the previous save."""
        strategy = TorchDistSaveShardedStrategy(
            thread_count=2, cached_metadata=True, crc32=False, reuse_staging_buffers=True
        )
        return FullyParallelSaveStrategyWrapper(strategy, do_cache_distribution=True)

    def validate_once(self, name: str) -> bool:
        """With a constant structure the sharding is validated at the first save only (as DistCheckpointIO does)."""
        first = name not in self.validated
        self.validated.add(name)
        return first

    def save_dd(self) -> None:
        path = self.path("dd") / f"rank{self.rank}"
        count = sum(t.numel() * t.element_size() for t in self.state.values()) // (1 << 20)
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fdatasync", "status=none"], check=True
        )

    def save_torch(self) -> None:
        path = self.path("torch.save") / f"rank{self.rank}.pt"
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def save_dcp(self) -> None:
        torch.distributed.checkpoint.save(self.dtensors(), checkpoint_id=self.path("dcp"))

    def save_mcore(self) -> None:
        self.mcore.save(self.sharded(self.mcore), self.path("megatron-core"))

    def save_ours(self) -> None:
        dc.save(
            self.sharded(dc), self.path("ours"), self.ours_sync, validate_access_integrity=self.validate_once("sync")
        )

    def save_ours_async(self) -> None:
        def schedule() -> None:
            request = dc.save(
                self.sharded(dc),
                self.path("ours async"),
                self.ours_async,
                async_sharded_save=True,
                validate_access_integrity=self.validate_once("async"),
            )
            self.queue.schedule_async_request(request)

        self.blocked = timed(schedule)
        self.queue.maybe_finalize_async_calls(blocking=True)

    def memcpy(self) -> None:
        [t.clone() for t in self.state.values()]

    def load_dd(self, source: str, files: list[str]) -> None:
        for name in files:
            subprocess.run(
                ["dd", f"if={self.root / source / name}", "of=/dev/null", "bs=4M", "status=none"], check=True
            )

    def load_torch(self) -> None:
        torch.load(self.root / "torch_save" / f"rank{self.rank}.pt", weights_only=True)

    def load_dcp(self, source: str) -> None:
        torch.distributed.checkpoint.load(self.dtensors(template=True), checkpoint_id=self.root / source)

    def load_mcore(self, source: str) -> None:
        self.mcore.load(self.sharded(self.mcore, template=True), self.root / source)

    def load_ours(self, source: str) -> None:
        dc.load(
            self.sharded(dc, template=True),
            self.root / source,
            FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()),
        )


def run_rank(
    rank: int, world: int, port: int, size: int, reps: int, root: str, reshard_from: str | None, results: dict
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    c = Contestants(Path(root) / config_dir(size, world), size, rank, world)
    saves: dict[str, Callable[[], None]] = {
        "dd": c.save_dd,
        "torch.save": c.save_torch,
        "dcp": c.save_dcp,
        "ours": c.save_ours,
        "ours async": c.save_ours_async,
        "memcpy": c.memcpy,
    }
    if c.mcore is not None:
        saves["megatron-core"] = c.save_mcore
    times: dict[str, list[float]] = {name: [] for name in saves}
    times["ours async (blocked)"] = []
    loads: dict[str, Callable[[], None]] = {
        "dd": lambda: c.load_dd("dd", [f"rank{rank}"]),
        "torch.load": c.load_torch,
        "dcp": lambda: c.load_dcp("dcp"),
        "ours": lambda: c.load_ours("ours"),
    }
    if c.mcore is not None:
        loads["megatron-core"] = lambda: c.load_mcore("mcore")
    if reshard_from is not None:
        source = Path(reshard_from)
        c.root = source  # read the 2-rank checkpoints
        loads = {
            "dd": lambda: c.load_dd("dd", sorted(p.name for p in (source / "dd").iterdir())),
            "dcp": lambda: c.load_dcp("dcp"),
            "ours": lambda: c.load_ours("ours"),
        }
        if c.mcore is not None:
            loads["megatron-core"] = lambda: c.load_mcore("mcore")
    load_times: dict[str, list[float]] = {name: [] for name in loads}
    for rep in range(reps):
        shuffle = random.Random(rep).shuffle
        if reshard_from is None:
            order = list(saves)
            shuffle(order)
            for name in order:
                c.clear(name)
                drop_caches()
                elapsed = timed(saves[name])
                times[name].append(elapsed)
                if name == "ours async":
                    times["ours async (blocked)"].append(c.blocked)
        order = list(loads)
        shuffle(order)
        for name in order:
            drop_caches()
            load_times[name].append(timed(loads[name]))
    if rank == 0:
        results["save"] = {k: v for k, v in times.items() if v}
        results["load"] = load_times
    c.queue.close()
    dist.destroy_process_group()


def run_config(size: int, world: int, reps: int, root: Path, reshard_from: Path | None = None) -> dict:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(
            run_rank,
            args=(
                world,
                free_port(),
                size,
                reps,
                str(root),
                None if reshard_from is None else str(reshard_from),
                results,
            ),
            nprocs=world,
        )
        return dict(results)


def table(all_results: dict) -> str:
    """Markdown: medians per contestant and their ratios to dd (async: blocked time to memcpy)."""
    lines = [
        "| size | ranks | contestant | save median s | save: dd / it | load median s (cold) | load: dd / it |",
        "|---|---|---|---|---|---|---|",
    ]
    for (size_gib, ranks, kind), result in all_results.items():
        save = {k: statistics.median(v) for k, v in result.get("save", {}).items()}
        load = {k: statistics.median(v) for k, v in result.get("load", {}).items()}
        label = f"{ranks}" if kind == "same" else f"{ranks} (saved on 2)"
        for name in dict.fromkeys(list(save) + list(load)):
            s, ld = save.get(name), load.get(name)
            if name == "ours async (blocked)":
                ratio = f"{s / save['memcpy']:.2f} x memcpy"
            else:
                ratio = f"{save['dd'] / s:.2f}" if s and "dd" in save else ""
            cells = [
                f"{size_gib} GiB",
                label,
                name,
                "" if s is None else f"{s:.2f}",
                ratio,
                "" if ld is None else f"{ld:.2f}",
                f"{load['dd'] / ld:.2f}" if ld and "dd" in load else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(all_results: dict, text: str, path: Path, reps: int, note: str) -> None:
    section = (
        f"{SECTION}\n\n`python benchmarks/ckpt_bench.py` on this 2-core VM, {reps} interleaved repetitions "
        f"(shuffled order, page cache dropped before every save and load), medians; ratios to "
        f"`dd conv=fdatasync` (save, higher is better) and to a cold `dd` read (load). "
        f"`ours async (blocked)`: the time the training loop waits, as a ratio to cloning the state into "
        f"new memory (`memcpy`). {note}\n\n{text}\n\n![checkpoint speed](ckpt_speed.png)\n"
    )
    write_section(section, path)


def plot(all_results: dict, path: Path) -> None:
    """One row of panels per size: save and load medians of every contestant, per rank configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(config[0] for config in all_results))
    columns = max(sum(config[0] == size for config in all_results) for size in sizes)
    fig, axes = plt.subplots(len(sizes), columns, figsize=(4.5 * columns, 4 * len(sizes)), squeeze=False)
    for row, size in zip(axes, sizes):
        configs = [config for config in all_results if config[0] == size]
        for ax in row[len(configs) :]:
            ax.axis("off")
        for ax, config in zip(row, configs):
            result = all_results[config]
            bars = {f"save {k}": statistics.median(v) for k, v in result.get("save", {}).items()}
            bars.update({f"load {k}": statistics.median(v) for k, v in result.get("load", {}).items()})
            ax.barh(
                list(bars),
                list(bars.values()),
                color=["tab:blue" if k.startswith("save") else "tab:green" for k in bars],
            )
            ax.set_title(f"{size} GiB, {config[1]} rank(s){' reshard' if config[2] != 'same' else ''}")
            ax.set_xlabel("median seconds")
            ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    check_dependencies(["matplotlib"], {"megatron.core": MEGATRON_CORE_INSTALL})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 4])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_bench"))
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    all_results = {}
    sizes = [int(s * (1 << 30)) // TENSOR_BYTES * TENSOR_BYTES for s in args.sizes_gib]
    for size in sizes:
        size_gib = round(size / (1 << 30), 2)
        for world in args.ranks:
            print(f"{size_gib} GiB on {world} rank(s)", flush=True)
            all_results[(size_gib, world, "same")] = run_config(size, world, args.reps, args.dir)
            if world == 2:
                for name in set(SAVE_DIRS.values()) - RESHARD_SOURCES:
                    shutil.rmtree(args.dir / config_dir(size, 2) / name, ignore_errors=True)
            if world == 1 and 2 in args.ranks:
                print(f"{size_gib} GiB reshard 2 -> 1", flush=True)
                all_results[(size_gib, 1, "reshard")] = run_config(
                    size, 1, args.reps, args.dir, reshard_from=args.dir / config_dir(size, 2)
                )
            print(json.dumps({k: v for k, v in all_results[(size_gib, world, "same")].items()}), flush=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    text = table(all_results)
    print(text)
    write_results(all_results, text, args.results, args.reps, args.note)
    plot(all_results, args.results.parent / "ckpt_speed.png")


if __name__ == "__main__":
    main()

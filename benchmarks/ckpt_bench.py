"""Checkpoint save/load speed against the disk's ceiling and the peers at their best settings.

    python benchmarks/ckpt_bench.py [--sizes-gib 1 4] [--ranks 2 1] [--reps 3 2] [--dir /tmp/ckpt_bench] [--device cuda]

Every rank holds `--sizes-gib` of 64 MiB float32 tensors of random values, its rows of global tensors split along
dim 0 (as FSDP or tensor parallelism shards them). Per repetition every contestant runs once, in an order shuffled
each repetition (the same on every rank), so a loaded machine slows all alike; medians. The saves' repetitions come
first; then the copies of the state that async contestants and memcpy keep are freed (a resuming process holds its
state once) and the loads' repetitions follow (`LOAD_REPS_PER_SAVE_REP` x as many), each reading what its
contestant saved last. Every save and load starts with the page cache dropped (when root). Times are the slowest
rank's, between two barriers; a save's time does not include removing the previous repetition's files.

Contestants (all with torch.save's zip CRC-32s off, as ours writes them; the `zip CRCs` rows turn them on):
- the disk ceiling (`disk_ceiling.py`): `dd conv=fdatasync` in 1, 2, 4, 8 parallel streams per rank and O_DIRECT
  writes, of pseudo-random bytes from memory (not zeros, which a virtual disk may skip); cold `dd` reads in 1, 2,
  4, 8 streams and O_DIRECT reads. The best median is the ceiling that every save and load is quoted against;
  `dd x1` (one buffered stream, the old baseline) is a reference row.
- `torch.save` / `torch.load` of each rank's dict to its own file (fsynced).
- DCP (`torch.distributed.checkpoint`) with 2 writer threads per rank, as ours; `dcp async_save` with a kept
  `DefaultStager` (it reuses its CPU copies) staging in its background thread (from a GPU: into pinned memory, and
  `dcp async_save, unpinned` into pageable memory).
- megatron-core (when importable, e.g. PYTHONPATH=.venv/megatron-core-0.19.2; its CUDA calls are no-ops on CPU) with its
  fully parallel save wrapper, cached distribution and metadata, 2 threads, validation at the first save only;
  its async path (`async_sharded_save`, its own AsyncCallsQueue).
- ours as `DistCheckpointIO` saves with `ckpt_parallel_save` and `ckpt_assume_constant_structure`, sync and async
  (staging into the buffers kept from the previous save); loads with the parallel load wrapper into the live
  tensors, as a resume does.
- `memcpy`: copying the state into preallocated memory and into new memory, the yardsticks of async staging.
With `--device cuda` the state lives on the GPUs (rank r on GPU r; NCCL next to gloo): saves stage it into pinned
host memory, loads go into the GPU tensors, and memcpy copies it into pinned host memory. An async save's blocked
time then runs until the current stream may go on (its device-to-host copies done), the time training's kernels
wait. The 1-rank run also loads the 2-rank checkpoints (a reshard). Async contestants, memcpy and torch.load run
where the machine has memory for the copies they keep. Writes `## Checkpoint speed` in benchmarks/RESULTS.md and
benchmarks/ckpt_speed.png. Needs about 6x the largest size x the sum of --ranks of free disk under --dir (checked
at the start); removes its files when it ends, also on failure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.serialization

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import disk_ceiling  # noqa: E402
from results import (  # noqa: E402
    MEGATRON_CORE_INSTALL,
    check_dependencies,
    free_port,
    gpu_ranks_error,
    settled,
    write_section,
)

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

TENSOR_BYTES = 64 << 20
ROW = 4096  # float32 values per row
SECTION = "## Checkpoint speed"
THREADS = 2  # writer threads (files) per rank, for ours and every peer that has the setting
CEILING_DIR = "ceiling"
REFERENCE = "dd x1"  # the old baseline: one buffered stream per rank
# the 2-rank saves that the 1-rank run loads (a reshard); every other save directory is removed after its run
LOADED_SAVES = ("torch.save", "dcp", "ours", "megatron-core")
DCP_UNPINNED = "dcp async_save, unpinned"  # from a GPU only
ASYNC = ("ours async", "dcp async_save", DCP_UNPINNED, "megatron-core async")
SAVE_ONLY = ("dcp, zip CRCs", "ours, zip CRCs", *ASYNC)
MEMCPY = ("memcpy (preallocated)", "memcpy (new memory)")
LOAD_REPS_PER_SAVE_REP = 2  # loads take a fraction of a save's time, and cold reads on a virtual disk vary more
ASYNC_COPIES = 5  # copies of the state a rank holds with the async contestants: its own and four kept ones (one
# more from a GPU: DCP's unpinned copies)
# files on disk at the peak, in states per rank: a run's ceiling and contestants' saves, and the 2-rank saves the
# 1-rank run loads
DISK_COPIES = 6


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


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def local_state(size: int, rank: int, shards: int = 1, device: str = "cpu") -> dict[str, torch.Tensor]:
    """This rank's rows of `size // 64 MiB` global float32 tensors: 64 MiB each (`shards` times that where a
    rank loads what `shards` ranks saved), of normally distributed values as trained weights are (a virtual disk
    may move blocks of zeros or of one repeated value faster than the bytes a checkpoint holds)."""
    rows = TENSOR_BYTES // 4 // ROW * shards
    generator = torch.Generator().manual_seed(rank)
    return {f"t{i}": torch.randn((rows, ROW), generator=generator).to(device) for i in range(size // TENSOR_BYTES)}


def config_dir(size: int, world: int) -> str:
    return f"{size >> 20}mib_per_rank_{world}r"


def drop_caches() -> None:
    """Write back and drop the page cache (root only), on rank 0, then barrier."""
    if dist.get_rank() == 0:
        disk_ceiling.drop_caches()
    dist.barrier()


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` takes on the slowest rank, between barriers."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([settled() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


@contextmanager
def zip_crc32(enabled: bool):
    """torch.save's zip CRC-32s on or off (torch.save, DCP and megatron-core all write through it)."""
    config = torch.utils.serialization.config.save
    before, config.compute_crc32 = config.compute_crc32, enabled
    try:
        yield
    finally:
        config.compute_crc32 = before


class Contestants:
    """Each contestant's save and load on this rank, writing under `root`: the disk ceiling's `dd` variants, and
    the libraries at their best settings (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        ceiling_source: Path | None,
        size: int,
        rank: int,
        world: int,
        with_async: bool,
        shards: int = 1,
        device: str = "cpu",
    ) -> None:
        self.root, self.ceiling_source, self.rank, self.world, self.size = root, ceiling_source, rank, world, size
        self.device = device
        self.state = local_state(size, rank, shards, device)
        self.rows = next(iter(self.state.values())).shape[0]
        self.mcore = megatron_dist_checkpointing()
        self.mesh = torch.distributed.device_mesh.init_device_mesh(device.split(":")[0], (world,))
        self.ours = {crc: self.ours_save_strategy(crc) for crc in (False, True)}
        self.ours_async = self.ours_save_strategy(False)
        self.queue = AsyncCallsQueue()
        self.mcore_strategy = self.mcore_save_strategy() if self.mcore else None
        self.mcore_async_strategy = self.mcore_save_strategy() if self.mcore else None
        self.mcore_queue = None
        self.dcp_async_stagers: dict[bool, Any] = {}  # DCP's DefaultStager, by pinned or not
        self.with_async = with_async
        self.preallocated: dict[str, torch.Tensor] = {}
        self.blocked: dict[str, float] = {}
        self.validated: set[str] = set()

    # save side

    def saves(self) -> dict[str, Callable[[], None]]:
        saves: dict[str, Callable[[], None]] = {
            name: (lambda s=streams, d=direct: self.save_ceiling(s, d))
            for name, (streams, direct) in disk_ceiling.write_variants().items()
        }
        saves |= {
            "torch.save": self.save_torch,
            "dcp": self.save_dcp,
            "dcp, zip CRCs": lambda: self.save_dcp(crc=True),
            "ours": self.save_ours,
            "ours, zip CRCs": lambda: self.save_ours(crc=True),
        }
        if self.with_async:
            saves |= {
                "ours async": self.save_ours_async,
                "dcp async_save": self.save_dcp_async,
                "memcpy (preallocated)": self.memcpy_preallocated,
                "memcpy (new memory)": self.memcpy_new,
            }
            if self.device == "cuda":
                saves[DCP_UNPINNED] = lambda: self.save_dcp_async(pinned=False)
        if self.mcore is not None:
            saves["megatron-core"] = self.save_mcore
            if self.with_async:
                saves["megatron-core async"] = self.save_mcore_async
        return saves

    def clear(self, contestant: str) -> None:
        """An empty directory for `contestant`'s save (the ceiling: this rank's files of that variant)."""
        if contestant in disk_ceiling.write_variants():
            (self.root / CEILING_DIR).mkdir(parents=True, exist_ok=True)
            for path in (self.root / CEILING_DIR).glob(f"rank{self.rank}_*x{contestant.split('x')[-1]}_*"):
                path.unlink()
        elif self.rank == 0 and contestant not in MEMCPY:
            shutil.rmtree(self.path(contestant), ignore_errors=True)
            self.path(contestant).mkdir(parents=True)
        dist.barrier()

    def after_save(self, contestant: str) -> None:
        """Remove what no load reads (untimed): O_DIRECT and unread `dd` files, save-only contestants."""
        if contestant in disk_ceiling.write_variants() and contestant != disk_ceiling.READ_SOURCE:
            self.clear(contestant)
        elif contestant in SAVE_ONLY and self.rank == 0:
            shutil.rmtree(self.path(contestant), ignore_errors=True)
        dist.barrier()

    def path(self, contestant: str) -> Path:
        return self.root / slug(contestant)

    def sharded(self, lib) -> dict:
        """The state as `lib`'s ShardedTensors: each tensor split along dim 0 over the ranks."""
        return {
            key: lib.ShardedTensor.from_rank_offsets(key, t, (0, self.rank, self.world))
            for key, t in self.state.items()
        }

    def dtensors(self) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        return {key: DTensor.from_local(t, self.mesh, [Shard(0)], run_check=False) for key, t in self.state.items()}

    def ours_save_strategy(self, crc: bool) -> FullyParallelSaveStrategyWrapper:
        """As `DistCheckpointIO` saves with `ckpt_parallel_save` and `ckpt_assume_constant_structure`: 2 writer
        threads per rank, cached structure and distribution, staging buffers kept between async saves, item
        checksums (checksums.json); `crc`: the zip CRC-32s too."""
        strategy = TorchDistSaveShardedStrategy(
            thread_count=THREADS, cached_metadata=True, crc32=crc, reuse_staging_buffers=True
        )
        return FullyParallelSaveStrategyWrapper(strategy, do_cache_distribution=True)

    def mcore_save_strategy(self):
        """megatron-core's best practice: fully parallel save, cached distribution and metadata, 2 threads."""
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper as McoreFullyParallel,
        )
        from megatron.core.dist_checkpointing.strategies.torch import (
            TorchDistSaveShardedStrategy as McoreTorchDist,
        )

        return McoreFullyParallel(
            McoreTorchDist("torch_dist", 1, thread_count=THREADS, cached_metadata=True), do_cache_distribution=True
        )

    def validate_once(self, name: str) -> bool:
        """With a constant structure the sharding is validated at the first save only (as DistCheckpointIO does)."""
        first = name not in self.validated
        self.validated.add(name)
        return first

    def save_ceiling(self, streams: int, direct: bool) -> None:
        directory, prefix = self.root / CEILING_DIR, f"rank{self.rank}_"
        disk_ceiling.write(directory, self.ceiling_source, self.size, streams, direct, prefix=prefix)

    def save_torch(self) -> None:
        with open(self.path("torch.save") / f"rank{self.rank}.pt", "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())

    def save_dcp(self, crc: bool = False) -> None:
        name = "dcp, zip CRCs" if crc else "dcp"
        writer = torch.distributed.checkpoint.FileSystemWriter(self.path(name), thread_count=THREADS)
        with zip_crc32(crc):
            torch.distributed.checkpoint.save(self.dtensors(), storage_writer=writer)

    def save_dcp_async(self, pinned: bool = True) -> None:
        """DCP's `async_save` with its `DefaultStager`, kept between saves (it reuses its CPU copies), staging in
        its background thread; pinned (unless not `pinned`) and non-blocking copies where there is an accelerator.
        Blocked: until the state is staged (training may change it only then)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        accelerator = torch.accelerator.is_available()
        name = "dcp async_save" if pinned else DCP_UNPINNED
        if pinned not in self.dcp_async_stagers:
            self.dcp_async_stagers[pinned] = DefaultStager(
                StagingOptions(
                    use_pinned_memory=accelerator and pinned,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=accelerator,
                )
            )
        writer = torch.distributed.checkpoint.FileSystemWriter(self.path(name), thread_count=THREADS)
        start = time.perf_counter()
        response = torch.distributed.checkpoint.async_save(
            self.dtensors(), storage_writer=writer, async_stager=self.dcp_async_stagers[pinned]
        )
        response.staging_completion.result()
        self.blocked[name] = settled() - start
        response.upload_completion.result()

    def save_mcore(self) -> None:
        self.mcore.save(
            self.sharded(self.mcore),
            str(self.path("megatron-core")),
            self.mcore_strategy,
            validate_access_integrity=self.validate_once("mcore"),
        )

    def save_mcore_async(self) -> None:
        """megatron-core's async path: `async_sharded_save` on its AsyncCallsQueue, which forks a writer process
        per save (its persistent worker process dies at its first request on a CPU-only machine)."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as McoreQueue

        if self.mcore_queue is None:
            self.mcore_queue = McoreQueue()
        start = time.perf_counter()
        request = self.mcore.save(
            self.sharded(self.mcore),
            str(self.path("megatron-core async")),
            self.mcore_async_strategy,
            validate_access_integrity=self.validate_once("mcore async"),
            async_sharded_save=True,
            async_strategy="mcore",
        )
        self.mcore_queue.schedule_async_request(request)
        self.blocked["megatron-core async"] = settled() - start
        self.mcore_queue.maybe_finalize_async_calls(blocking=True)

    def save_ours(self, crc: bool = False) -> None:
        name = "ours, zip CRCs" if crc else "ours"
        dc.save(self.sharded(dc), self.path(name), self.ours[crc], validate_access_integrity=self.validate_once(name))

    def save_ours_async(self) -> None:
        start = time.perf_counter()
        request = dc.save(
            self.sharded(dc),
            self.path("ours async"),
            self.ours_async,
            async_sharded_save=True,
            validate_access_integrity=self.validate_once("ours async"),
        )
        self.queue.schedule_async_request(request)
        self.blocked["ours async"] = settled() - start
        self.queue.maybe_finalize_async_calls(blocking=True)

    def memcpy_preallocated(self) -> None:
        """Copy the state into host memory kept from the previous repetition (what staging into kept buffers
        costs); from a GPU into pinned memory, without blocking the host."""
        for key, t in self.state.items():
            if key not in self.preallocated:
                self.preallocated[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self.preallocated[key].copy_(t, non_blocking=t.is_cuda)

    def memcpy_new(self) -> None:
        """Copy the state into new host memory (what staging without kept buffers costs; pinned from a GPU)."""
        for t in self.state.values():
            torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t, non_blocking=t.is_cuda)

    # load side: into the live tensors, as a resume does

    def loads(self, source: Path, source_world: int) -> dict[str, Callable[[], None]]:
        # the saving ranks' `dd` files this rank reads: its own, or in a reshard its share of all of them
        shards = source_world // self.world
        files = [
            path
            for rank in range(self.rank * shards, (self.rank + 1) * shards)
            for path in disk_ceiling.stream_files(
                source / CEILING_DIR, disk_ceiling.write_variants()[disk_ceiling.READ_SOURCE][0], f"rank{rank}_"
            )
        ]
        loads: dict[str, Callable[[], None]] = {
            name: (lambda s=streams, d=direct: disk_ceiling.read(files, s * shards, d))
            for name, (streams, direct) in disk_ceiling.read_variants().items()
        }
        loads |= {
            "dcp": lambda: self.load_dcp(source / slug("dcp")),
            "ours": lambda: self.load_ours(source / slug("ours")),
        }
        if source_world == self.world and self.with_async:  # torch.load reads into new memory: a second copy
            loads["torch.load"] = self.load_torch
        if self.mcore is not None:
            loads["megatron-core"] = lambda: self.load_mcore(source / slug("megatron-core"))
        return loads

    def load_torch(self) -> None:
        path = self.path("torch.save") / f"rank{self.rank}.pt"
        loaded = torch.load(path, weights_only=True, mmap=False, map_location=self.device)
        for key, t in self.state.items():
            t.copy_(loaded[key])

    def load_dcp(self, source: Path) -> None:
        torch.distributed.checkpoint.load(self.dtensors(), checkpoint_id=source)

    def load_mcore(self, source: Path) -> None:
        self.mcore.load(self.sharded(self.mcore), str(source))

    def load_ours(self, source: Path) -> None:
        dc.load(self.sharded(dc), source, FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))

    def release_copies(self) -> None:
        """Free the state's copies the async contestants and memcpy keep between saves."""
        self.preallocated = {}
        self.ours_async = self.ours_save_strategy(False)
        for stager in self.dcp_async_stagers.values():
            stager.close()
        self.dcp_async_stagers = {}
        self.mcore_async_strategy = self.mcore_save_strategy() if self.mcore else None
        gc.collect()

    def close(self) -> None:
        self.queue.close()
        if self.mcore_queue is not None:
            self.mcore_queue.close()


def run_rank(
    rank: int,
    world: int,
    port: int,
    size: int,
    reps: int,
    root: str,
    ceiling_source: str | None,
    with_async: bool,
    reshard_from: str | None,
    device: str,
    results: dict,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("cpu:gloo,cuda:nccl" if device != "cpu" else "gloo", rank=rank, world_size=world)
    torch.utils.serialization.config.save.compute_crc32 = False  # equal for all; "zip CRCs" rows turn it on
    # a reshard loads what twice the ranks saved, each of half this rank's size
    save_world = world if reshard_from is None else 2 * world
    c = Contestants(
        Path(root) / config_dir(size, world),
        None if ceiling_source is None else Path(ceiling_source),
        size,
        rank,
        world,
        with_async,
        save_world // world,
        device,
    )
    saves = c.saves() if reshard_from is None else {}
    source = c.root if reshard_from is None else Path(reshard_from)
    loads = c.loads(source, save_world)
    times: dict[str, list[float]] = {name: [] for name in saves}
    blocked: dict[str, list[float]] = {name: [] for name in ASYNC if name in saves}
    load_times: dict[str, list[float]] = {name: [] for name in loads}
    for rep in range(reps):
        shuffle = random.Random(rep).shuffle
        order = list(saves)
        shuffle(order)
        for name in order:
            c.clear(name)
            drop_caches()
            times[name].append(timed(saves[name]))
            if name in blocked:
                value = torch.tensor([c.blocked[name]], dtype=torch.float64)
                dist.all_reduce(value, op=dist.ReduceOp.MAX)
                blocked[name].append(value.item())
            c.after_save(name)
    # a resume loads into a process that holds its state once: free the copies kept by the async contestants
    # and memcpy before the loads (with them, 5 copies at 4 GiB on 1 rank left the page cache little room)
    c.release_copies()
    for rep in range(reps * LOAD_REPS_PER_SAVE_REP):
        order = list(loads)
        random.Random(rep).shuffle(order)
        for name in order:
            drop_caches()
            load_times[name].append(timed(loads[name]))
    if rank == 0:
        results["save"] = times
        results["blocked"] = blocked
        results["load"] = load_times
    c.close()
    dist.destroy_process_group()


def run_config(
    size: int,
    world: int,
    reps: int,
    root: Path,
    with_async: bool,
    reshard_from: Path | None = None,
    device: str = "cpu",
) -> dict:
    # the bytes the ceiling's `dd` writes copy (every rank the same), where this run saves
    ceiling_source = disk_ceiling.source_file(size) if reshard_from is None else None
    try:
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
                    None if ceiling_source is None else str(ceiling_source),
                    with_async,
                    None if reshard_from is None else str(reshard_from),
                    device,
                    results,
                ),
                nprocs=world,
            )
            return dict(results)
    finally:
        if ceiling_source is not None:
            ceiling_source.unlink()


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in times.items() if values}


def table(all_results: dict) -> str:
    """Markdown: medians per contestant, saves and loads as a fraction of the disk ceiling's speed (ceiling time
    / its time: 1.00 is the disk's best), async blocked time as a multiple of a copy into preallocated memory."""
    lines = [
        "| GiB per rank | ranks | contestant | save s | save speed / ceiling | blocked s | blocked / memcpy "
        "(prealloc.) | load s (cold) | load speed / ceiling |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (size_gib, ranks, kind), result in all_results.items():
        save, load, blocked = medians(result["save"]), medians(result["load"]), medians(result["blocked"])
        writes = {k: v for k, v in save.items() if k in CEILING_WRITES}
        write_best, write_ceiling = disk_ceiling.best(writes) if writes else (None, None)
        read_best, read_ceiling = disk_ceiling.best({k: v for k, v in load.items() if k in CEILING_READS})
        label = f"{ranks}" if kind == "same" else f"{ranks} (saved on {2 * ranks})"
        memcpy = save.get("memcpy (preallocated)")
        for name in dict.fromkeys(list(save) + list(load)):
            s, ld, b = save.get(name), load.get(name), blocked.get(name)
            marks = (" **(write ceiling)**" if name == write_best and s else "") + (
                " **(read ceiling)**" if name == read_best and ld else ""
            )
            cells = [
                f"{size_gib}",
                label,
                name + (" (reference)" if name == REFERENCE else "") + marks,
                "" if s is None else f"{s:.2f}",
                "" if s is None or name in MEMCPY else f"{write_ceiling / s:.2f}",
                "" if b is None else f"{b:.3f}",
                "" if b is None or memcpy is None else f"{b / memcpy:.2f}",
                "" if ld is None else f"{ld:.2f}",
                "" if ld is None else f"{read_ceiling / ld:.2f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CEILING_WRITES = set(disk_ceiling.write_variants())
CEILING_READS = set(disk_ceiling.read_variants())


def check_free_disk(directory: Path, needed: int) -> None:
    """Exit with a message if the file system of `directory` has less than `needed` bytes free."""
    existing = next(p for p in [directory, *directory.parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        sys.exit(
            f"ckpt_bench: {needed / (1 << 30):.0f} GiB of free disk needed under --dir {directory} "
            f"({free / (1 << 30):.0f} GiB free): pass a --dir with more room, or smaller --sizes-gib / fewer --ranks"
        )


def available_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes (0 where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def write_results(text: str, path: Path, reps: str, note: str) -> None:
    section = (
        f"{SECTION}\n\n`python benchmarks/ckpt_bench.py --reps {reps}` on this 2-core VM: every contestant once per "
        "repetition in a shuffled order, the saves' repetitions first, then the copies kept by the async "
        f"contestants freed, then {LOAD_REPS_PER_SAVE_REP}x as many loads' repetitions; page cache dropped before "
        "every save and load; medians; the slowest rank's time. `speed / ceiling`: the disk ceiling's median time "
        "over the contestant's (1.00: as fast as the best `dd` variant measured in the same run; the ceiling row is "
        "marked). `blocked`: the time an async save holds the caller before writing in the background, against "
        f"copying the state into preallocated memory. {note}\n\n{text}\n\n![checkpoint speed](ckpt_speed.png)\n"
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
    check_dependencies(["matplotlib"], {"megatron.core": MEGATRON_CORE_INSTALL}, programs=["dd"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1, 4], help="state per rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--reps", type=int, nargs="+", default=[3], help="per size (the last one for the rest)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ckpt_bench"))
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    parser.add_argument("--note", default="", help="appended to the RESULTS.md section (machine, load)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the state lives")
    args = parser.parse_args()
    if error := gpu_ranks_error(args.ranks, args.device):
        parser.error(error)
    for option in ("ranks", "reps"):
        if min(getattr(args, option)) < 1:
            parser.error(f"--{option} {' '.join(map(str, getattr(args, option)))}: use 1 or more")
    if min(args.sizes_gib) * (1 << 30) < TENSOR_BYTES:
        parser.error(
            f"--sizes-gib {' '.join(map(str, args.sizes_gib))}: the state is made of {TENSOR_BYTES >> 20} MiB "
            f"tensors; use {TENSOR_BYTES / (1 << 30)} or more"
        )
    sizes = [int(s * (1 << 30)) // TENSOR_BYTES * TENSOR_BYTES for s in args.sizes_gib]
    check_free_disk(args.dir, max(sizes) * DISK_COPIES * sum(args.ranks))
    all_results = {}
    try:
        for index, size in enumerate(sizes):
            size_gib = round(size / (1 << 30), 2)
            reps = args.reps[min(index, len(args.reps) - 1)]
            for world in args.ranks:
                # async contestants and memcpy each keep a copy of the state (ours, DCP's cached staging, memcpy,
                # megatron-core), torch.load reads into new memory
                copies = ASYNC_COPIES + (args.device == "cuda")
                with_async = world * size * copies + disk_ceiling.SOURCE_BYTES <= available_memory()
                if not with_async:
                    print(f"{size_gib} GiB per rank on {world} rank(s): async, memcpy, torch.load left out (memory)")
                print(f"{size_gib} GiB per rank on {world} rank(s)", flush=True)
                all_results[(size_gib, world, "same")] = run_config(
                    size, world, reps, args.dir, with_async, device=args.device
                )
                print(json.dumps(all_results[(size_gib, world, "same")]), flush=True)
                if world == 1 and 2 in args.ranks:
                    print(f"{size_gib} GiB per saving rank, reshard 2 -> 1", flush=True)
                    all_results[(size_gib, 1, "reshard")] = run_config(
                        size, 1, reps, args.dir, False, args.dir / config_dir(size, 2), args.device
                    )
                    print(json.dumps(all_results[(size_gib, 1, "reshard")]), flush=True)
            shutil.rmtree(args.dir, ignore_errors=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    text = table(all_results)
    print(text)
    if not args.no_write:
        write_results(text, args.results, " ".join(map(str, args.reps)), args.note)
        plot(all_results, args.results.parent / "ckpt_speed.png")


if __name__ == "__main__":
    main()

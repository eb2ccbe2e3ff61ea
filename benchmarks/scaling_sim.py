"""Checkpoint metadata at 8 to 256 ranks, simulated in one process: what the coordinator (rank 0) does at a save.

    python benchmarks/scaling_sim.py [--model llama3_8b] [--ranks 8 32 64 256] [--reps 3] [--torch-planner-max 64]

At the end of a torch_dist save every rank sends its write items and results to rank 0, which builds the
checkpoint's `.metadata` (one entry per tensor chunk) with `build_state_dict_metadata` and pickles it
(`FileSystemWriterAsync.finish`). This script builds the items that N ranks would send for the model's parameters
and both Adam moments (`--model`: a `gpt_config` preset, built on the meta device) and times that step, then the
same through torch's `DefaultSavePlanner.create_global_plan` (DCP's own path, which validates chunk overlaps
pairwise; up to `--torch-planner-max` ranks). Layouts: `fsdp` (every tensor sharded on dim 0 over the N ranks,
FSDP2 / ZeRO-3) and `ddp` (replicated; each tensor written once, by one rank: `ckpt_parallel_save` spreads them).
Prints, per layout and N: write items, median seconds (ours, torch's planner), `.metadata` MiB, files (2 writer
threads a rank). No process group: the gather itself (N payloads over the network) is not timed.
"""

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results import check_dependencies  # noqa: E402

check_dependencies(["torch"])

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

from nemo_ckpt._compat import StorageInfo  # noqa: E402
from nemo_ckpt.dist_checkpointing.strategies.filesystem_async import build_state_dict_metadata  # noqa: E402
from nemo_ckpt.models.gpt.model import GPT, gpt_config  # noqa: E402

WRITERS_PER_RANK = 2


def tensor_shapes(model: str) -> dict[str, torch.Size]:
    """Parameter and Adam-moment shapes of the model, by checkpoint key."""
    with torch.device("meta"):
        params = {name: p.shape for name, p in GPT(gpt_config(model)).named_parameters()}
    shapes = {f"model.{name}": shape for name, shape in params.items()}
    for moment in ("exp_avg", "exp_avg_sq"):
        shapes |= {f"optimizer.state.{moment}.{name}": shape for name, shape in params.items()}
    return shapes


def local_items(shapes: dict[str, torch.Size], rank: int, ranks: int, layout: str) -> list[WriteItem]:
    """The write items rank `rank` of `ranks` sends: its dim-0 shard of every tensor (fsdp), or every `ranks`-th
    whole tensor (ddp: one writer per replicated tensor)."""
    properties = TensorProperties(dtype=torch.float32)
    items = []
    for index, (key, shape) in enumerate(shapes.items()):
        if layout == "fsdp":
            rows = -(-shape[0] // ranks)
            start, stop = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
            if start == stop:
                continue
            offsets, sizes = (start, *[0] * (len(shape) - 1)), (stop - start, *shape[1:])
        elif index % ranks == rank:
            offsets, sizes = (0,) * len(shape), tuple(shape)
        else:
            continue
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items.append(
            WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=shape),
            )
        )
    return items


def write_results(items: list[WriteItem], rank: int) -> list[WriteResult]:
    """Where a rank's writer threads put its items: `__<rank>_<thread>.distcp`, one after another."""
    results, offsets = [], [0] * WRITERS_PER_RANK
    for i, item in enumerate(items):
        thread, nbytes = i % WRITERS_PER_RANK, item.tensor_data.chunk.sizes.numel() * 4
        info = StorageInfo(f"__{rank}_{thread}.distcp", offsets[thread], nbytes)
        offsets[thread] += nbytes
        results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=info))
    return results


def coordinator_metadata(all_items: list[list[WriteItem]], all_results: list[list[WriteResult]]) -> tuple[float, int]:
    """Seconds rank 0 takes to build and pickle `.metadata` (as `FileSystemWriterAsync.finish`), and its bytes."""
    start = time.perf_counter()
    metadata = Metadata(
        state_dict_metadata=build_state_dict_metadata(all_items),
        storage_data={result.index: result.storage_data for results in all_results for result in results},
    )
    size = len(pickle.dumps(metadata))
    return time.perf_counter() - start, size


def torch_planner_seconds(all_items: list[list[WriteItem]]) -> float:
    """Seconds of DCP's `DefaultSavePlanner.create_global_plan` on the same items (dedup, metadata, validation)."""
    start = time.perf_counter()
    DefaultSavePlanner().create_global_plan([SavePlan(items, planner_data={}) for items in all_items])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3_8b")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64, 256])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--torch-planner-max", type=int, default=64)
    args = parser.parse_args()
    shapes = tensor_shapes(args.model)
    print(f"{args.model}: {len(shapes)} tensors (parameters and 2 Adam moments); machine load shared, see below")
    print("layout  ranks  write_items  ours_s  torch_planner_s  metadata_MiB  files")
    for layout in ("fsdp", "ddp"):
        for ranks in args.ranks:
            all_items = [local_items(shapes, rank, ranks, layout) for rank in range(ranks)]
            all_results = [write_results(items, rank) for rank, items in enumerate(all_items)]
            runs = [coordinator_metadata(all_items, all_results) for _ in range(args.reps)]
            ours = statistics.median(seconds for seconds, _ in runs)
            planner = "-"
            if ranks <= args.torch_planner_max:
                planner = f"{statistics.median(torch_planner_seconds(all_items) for _ in range(args.reps)):.3f}"
            items = sum(len(i) for i in all_items)
            size = runs[0][1] / 2**20
            files = ranks * WRITERS_PER_RANK
            print(f"{layout:6}  {ranks:5}  {items:11}  {ours:6.3f}  {planner:>15}  {size:12.2f}  {files:5}")


if __name__ == "__main__":
    main()

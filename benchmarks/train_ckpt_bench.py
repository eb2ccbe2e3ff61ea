"""Checkpoint cost as training sees it: a GPT whose model + optimizer state is over 1 GiB per rank, trained on
2 processes with `MegatronStrategy` and `ModelCheckpoint`, checkpointing every N steps.

    python benchmarks/train_ckpt_bench.py [--every 10] [--checkpoints 3] [--reps 2] [--ranks 2] [--device cuda]

Configurations, interleaved (rotated order per repetition), each in fresh processes: no checkpoint; sync saves;
async saves, both with the defaults (as NeMo's: `ckpt_parallel_save` and `ckpt_parallel_save_optim`, the
replicated DDP state written once, each rank its half; written by a thread of the training process); async saves
written by a writer process per rank (`ckpt_async_writer_process=True`); async saves without parallel save (rank
0 writes all of the replicated state); and, for reference, no checkpoint but the bytes a parallel save writes,
written by `dd` in the background at the same steps (O_DIRECT, at the lowest CPU priority). All with
`ckpt_assume_constant_structure` and 2 writer threads per rank, the data-parallel `no_shard` layout (DDP), AdamW,
1 torch thread per rank. With `--device cuda` rank r trains on GPU r (NCCL), async saves copy the state into pinned
memory on a side stream, and "async, overlapped staging" (`ckpt_async_overlap_staging`, GPU only: on CPU the same
as "async") lets the next forward and backward overlap those copies; `--seq-length` and `--micro-batch-size` make a
step long enough to overlap. Measured, on the slowest rank (on a
GPU, each step's start and end wait for the training stream):
- step time: every step's wall time (after warm-up) up to the next step's start, so with the checkpoint callback
  and the save it runs; median and the slowest step;
- time lost per checkpoint: (training time - the no-checkpoint run's) / number of checkpoints, training time being
  from the first measured step's start to the last step's end (the last save is finished inside it), each run
  against the no-checkpoint run of its repetition (the same round of the interleaving, minutes apart, so the pair
  shares more of the machine's drift than runs further apart); and, free of the run-to-run drift of that figure,
  the steps' excess: per checkpoint, the saving step and the 3 after it minus 4 x the median of the other steps up
  to the next save (the no-checkpoint row, at the same steps, is its noise floor), for the first checkpoint (which
  allocates the async staging memory) and the later ones apart;
- time to commit: from the save's start to its commit (the directory renamed, the manifest updated);
- CPU stolen by the host: the machine's `steal` time (/proc/stat, all CPUs: a virtual CPU ready to run while the
  hypervisor ran something else, e.g. its own side of the virtual disk's writes) over the measured steps, less
  the paired no-checkpoint run's, per checkpoint;
- staging memory: peak resident memory added per rank against the no-checkpoint run;
- the baseline of the async target: copying the model + optimizer state into preallocated memory.
Medians over repetitions. Writes `## Checkpoints during training` in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import disk_ceiling
import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results import (
    check_dependencies,
    free_port,
    gpu_ranks_error,
    join_process_group,
    measurement_trainer,
    settled,
    write_section,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nemo_ckpt.checkpoint import ModelCheckpoint  # noqa: E402
from nemo_ckpt.data import MockDataModule  # noqa: E402
from nemo_ckpt.models import GPTModel, gpt_config  # noqa: E402
from nemo_ckpt.optim import OptimizerConfig  # noqa: E402
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig  # noqa: E402
from nemo_ckpt.strategy import MegatronStrategy  # noqa: E402

SECTION = "## Checkpoints during training"
# 96M parameters: x 12 bytes (fp32 weights, Adam's two moments) = 1.07 GiB of model + optimizer state per rank
MODEL = {"num_layers": 2, "hidden_size": 256, "ffn_hidden_size": 688, "vocab_size": 184320, "seq_length": 32}
DEFAULT_SEQ_LENGTH = MODEL["seq_length"]
WARMUP_STEPS = 3
AFFECTED_STEPS = 4  # steps counted as a checkpoint's: the saving one and the next 3 (an async write takes 1-2)
WRITER_THREADS = 2  # ckpt_torch_dist_multiproc's default
BACKGROUND_WRITE = "background dd write, no checkpoint"
OVERLAPPED = "async, overlapped staging"
CONFIGS = {
    "no checkpoint": None,
    "sync": {},
    "async": {"ckpt_async_save": True},
    "async, 1 writer thread": {"ckpt_async_save": True, "ckpt_torch_dist_multiproc": 1},
    "async, writer process": {"ckpt_async_save": True, "ckpt_async_writer_process": True},
    OVERLAPPED: {"ckpt_async_save": True, "ckpt_async_overlap_staging": True},
    "async, no parallel save": {
        "ckpt_async_save": True,
        "ckpt_parallel_save": False,
        "ckpt_parallel_save_optim": False,
    },
    BACKGROUND_WRITE: None,
}


def cpu_stolen() -> float | None:
    """Seconds of CPU time the hypervisor has taken from this machine's CPUs since boot (`steal` in /proc/stat:
    time a virtual CPU was ready to run while the host ran something else), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            return int(stat.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


class Measure(pl.Callback):
    """Per step: start and end times; the CPU time stolen by the host from the first measured step to the end."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.stolen: list[float | None] = [None, None]

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(settled())
        if len(self.starts) == WARMUP_STEPS + 1:
            self.stolen[0] = cpu_stolen()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(settled())
        self.stolen[1] = cpu_stolen()


class TimedModelCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that records when each save starts and when it is committed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started: dict[int, float] = {}
        self.committed: dict[int, float] = {}

    def save(self, trainer: pl.Trainer, weights_only: bool = False) -> Path:
        self.started.setdefault(trainer.global_step, time.perf_counter())
        return super().save(trainer, weights_only)

    def _commit(self, trainer: pl.Trainer, record: Any) -> None:
        super()._commit(trainer, record)
        self.committed[record.step] = time.perf_counter()


class BackgroundWrite(pl.Callback):
    """A reference for an async checkpoint's cost: at the steps a checkpoint would be saved at, this rank's share
    of the model + optimizer state's bytes (as a parallel save writes: the replicated state split over the ranks)
    written by `dd` with O_DIRECT, in `WRITER_THREADS` streams to new files, in the background at the lowest CPU
    priority (as our writer threads run), from pseudo-random bytes in memory (as the disk ceiling's writes). No
    state dict, no staging copy, no metadata, no commit; but `dd` copies each block from its source into its
    buffer before writing it, where a checkpoint writes its staging buffers as they are."""

    def __init__(self, every: int, directory: Path) -> None:
        self.every, self.directory = every, directory
        self.started: dict[int, float] = {}
        self.committed: dict[int, float] = {}
        self.nbytes = 0
        self.source: Path | None = None
        self.waiter: threading.Thread | None = None
        self.error: BaseException | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights = sum(p.numel() * p.element_size() for p in pl_module.parameters())
        self.nbytes = 3 * weights // trainer.world_size  # fp32 weights and Adam's two moments
        self.source = disk_ceiling.source_file(self.nbytes)
        self.directory.mkdir(parents=True, exist_ok=True)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        self.wait()
        for path in self.directory.iterdir():
            path.unlink()
        self.started[trainer.global_step] = time.perf_counter()
        commands = disk_ceiling.write_commands(self.directory, self.source, self.nbytes, WRITER_THREADS, direct=True)
        processes = disk_ceiling.start(commands, idle=True)
        self.waiter = threading.Thread(target=self._finish, args=(trainer.global_step, processes), daemon=True)
        self.waiter.start()

    def _finish(self, step: int, processes: list) -> None:
        try:
            disk_ceiling.wait(processes)
        except BaseException as error:
            self.error = error
        self.committed[step] = time.perf_counter()

    def wait(self) -> None:
        """Wait for the write in flight; raise if it failed."""
        if self.waiter is not None:
            self.waiter.join()
            self.waiter = None
        if self.error is not None:
            raise self.error

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wait()
        self.source.unlink()


def state_tensors(model: pl.LightningModule, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [param.detach() for param in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    return tensors


def copy_time(tensors: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds to copy `tensors` into new host memory (the first copy, which faults it in; pinned for GPU tensors),
    and into memory kept from an earlier copy (median of 3 more)."""
    on_gpu = tensors[0].is_cuda
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu) for t in tensors]
    times = []
    for _ in range(4):
        start = settled()
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor, non_blocking=on_gpu)
        times.append(settled() - start)
    return times[0], statistics.median(times[1:])


def worker(
    rank: int,
    ranks: int,
    port: int,
    name: str,
    every: int,
    checkpoints: int,
    root: str,
    model_shape: dict,
    micro_batch_size: int,
    device: str,
    results: Any,
) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
    join_process_group(rank, ranks, port, backend="gloo" if device == "cpu" else "cpu:gloo,cuda:nccl")
    try:
        pl.seed_everything(0, verbose=False)
        options = CONFIGS[name]
        strategy = MegatronStrategy(
            ddp=DistributedDataParallelConfig(data_parallel_sharding_strategy="no_shard", overlap_grad_reduce=True),
            **({} if options is None else {"ckpt_assume_constant_structure": True, **options}),
        )
        config = gpt_config("tiny", **model_shape)
        model = GPTModel(config, OptimizerConfig(lr=1e-4))
        data = MockDataModule(
            seq_length=config.seq_length,
            vocab_size=config.vocab_size,
            micro_batch_size=micro_batch_size,
            global_batch_size=ranks * micro_batch_size,
        )
        measure = Measure()
        callbacks: list[pl.Callback] = [measure]
        checkpoint: TimedModelCheckpoint | BackgroundWrite | None = None
        if options is not None:
            checkpoint = TimedModelCheckpoint(
                dirpath=str(Path(root) / "checkpoints"), every_n_train_steps=every, save_top_k=1, save_last=False
            )
        elif name == BACKGROUND_WRITE:
            checkpoint = BackgroundWrite(every, Path(root) / f"background_rank{rank}")
        if checkpoint is not None:
            callbacks.append(checkpoint)
        steps = WARMUP_STEPS + every * checkpoints + every // 2
        trainer = measurement_trainer(ranks, strategy, steps, callbacks, "cpu" if device == "cpu" else "gpu")
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        trainer.fit(model, datamodule=data)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        tensors = state_tensors(model, trainer.optimizers[0])
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        copy_new, copy = copy_time(tensors)
        commits = []
        if checkpoint is not None:
            # the saves inside the measured steps (the one at the end of training is not)
            commits = [checkpoint.committed[s] - checkpoint.started[s] for s in checkpoint.committed if s < steps]
        per_rank: list[Any] = [None] * ranks
        dist.all_gather_object(per_rank, (measure.starts, measure.ends, peak, state_bytes, copy, copy_new, commits))
        if rank == 0:
            # a step: from its start to the next one's (the checkpoint callback runs in between), the last to its end
            step_times = [
                max((start[i + 1] if i + 1 < len(start) else end[i]) - start[i] for start, end, *_ in per_rank)
                for i in range(WARMUP_STEPS, len(measure.ends))
            ]
            results[name] = {
                "train": max(end[-1] - start[WARMUP_STEPS] for start, end, *_ in per_rank),
                "steps": step_times,
                "peak": max(p[2] for p in per_rank),
                "state_bytes": max(p[3] for p in per_rank),
                "copy": max(p[4] for p in per_rank),
                "copy_new": max(p[5] for p in per_rank),
                "commits": [max(c) for c in zip(*(p[6] for p in per_rank))],
                "checkpoints": checkpoints,
                "stolen": None if None in measure.stolen else measure.stolen[1] - measure.stolen[0],
            }
    finally:
        dist.destroy_process_group()


def run(
    names: list[str], ranks: int, every: int, checkpoints: int, reps: int, micro_batch_size: int, device: str
) -> dict[str, list[dict]]:
    measured: dict[str, list[dict]] = {name: [] for name in names}
    with mp.Manager() as manager:
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                root = tempfile.mkdtemp(prefix="train_ckpt_bench_", dir="/tmp")
                try:
                    results = manager.dict()
                    spawned = (ranks, free_port(), name, every, checkpoints, root, MODEL, micro_batch_size, device)
                    mp.spawn(worker, args=(*spawned, results), nprocs=ranks)
                    measured[name].append(dict(results[name]))
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                run_ = measured[name][-1]
                print(
                    f"rep {rep} {name}: train {run_['train']:.2f} s, median step {statistics.median(run_['steps']):.3f}"
                    f" s, commits {[round(c, 2) for c in run_['commits']]}, peak {run_['peak'] / 2**30:.2f} GiB",
                    flush=True,
                )
    return measured


def excess_per_checkpoint(steps: list[float], every: int, checkpoints: int) -> list[float]:
    """Per checkpoint, the time the saving step (the save runs after it) and the `AFFECTED_STEPS - 1` steps after
    it took beyond the median of the other steps up to the next save (a baseline local to the checkpoint, so a
    run whose speed drifts does not blur it)."""
    excess = []
    for k in range(1, checkpoints + 1):
        saving = every * k - 1 - WARMUP_STEPS
        window = steps[saving : saving + every]
        baseline = statistics.median(window[AFFECTED_STEPS:])
        excess.append(sum(step - baseline for step in window[:AFFECTED_STEPS]))
    return excess


def report(
    measured: dict[str, list[dict]],
    ranks: int,
    every: int,
    checkpoints: int,
    reps: int,
    note: str,
    micro_batch_size: int = 1,
    device: str = "cpu",
) -> str:
    base = measured["no checkpoint"]
    base_step = statistics.median(statistics.median(r["steps"]) for r in base)
    base_peak = statistics.median(r["peak"] for r in base)
    copy = statistics.median(r["copy"] for runs in measured.values() for r in runs)
    copies_new = [r["copy_new"] for runs in measured.values() for r in runs if "copy_new" in r]
    new_memory = (
        f", into new memory {statistics.median(copies_new):.3f} s (what faulting memory in costs the machine at the "
        "time; a run's first async save pays it for its staging buffers)"
        if copies_new
        else ""
    )
    state_gib = base[0]["state_bytes"] / 2**30
    lines = [
        "| configuration | median step s | slowest step s | lost per checkpoint s | lost / copy to preallocated "
        "| lost / interval at N=50 | step excess per checkpoint s | first checkpoint's excess s "
        "| later checkpoints' excess s | later / copy | time to commit s | peak memory added / rank GiB "
        "| CPU stolen by the host per checkpoint s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lost_by: dict[str, float] = {}
    for name, runs in measured.items():
        median_step = statistics.median(statistics.median(r["steps"]) for r in runs)
        slowest = statistics.median(max(r["steps"]) for r in runs)
        peak = statistics.median(r["peak"] for r in runs) - base_peak
        windows = [excess_per_checkpoint(r["steps"], every, checkpoints) for r in runs]
        excess = statistics.median(sum(w) for w in windows) / checkpoints
        first = statistics.median(w[0] for w in windows)
        later_values = [x for w in windows for x in w[1:]]  # none with --checkpoints 1
        later = f"{statistics.median(later_values):.2f}" if later_values else ""
        later_per_copy = f"{statistics.median(later_values) / copy:.2f}" if later_values else ""
        if name == "no checkpoint":
            cells = [name, f"{median_step:.3f}", f"{slowest:.3f}", "", "", "", f"{excess:.2f}", f"{first:.2f}"]
            cells += [later, "", "", "0 (baseline)", ""]
        else:
            lost = statistics.median((r["train"] - b["train"]) / checkpoints for r, b in zip(runs, base, strict=True))
            lost_by[name] = lost
            commit = statistics.median(c for r in runs for c in r["commits"])
            pairs = [(r.get("stolen"), b.get("stolen")) for r, b in zip(runs, base, strict=True)]
            stolen = [(s - sb) / checkpoints for s, sb in pairs if s is not None and sb is not None]
            cells = [
                name,
                f"{median_step:.3f}",
                f"{slowest:.3f}",
                f"{lost:.2f}",
                f"{lost / copy:.2f}",
                f"{lost / (50 * base_step):.1%}",
                f"{excess:.2f}",
                f"{first:.2f}",
                later,
                later_per_copy,
                f"{commit:.2f}",
                f"{peak / 2**30:.2f}",
                f"{statistics.median(stolen):.2f}" if stolen else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    options = f" --device {device}" if device != "cpu" else ""
    if MODEL["seq_length"] != DEFAULT_SEQ_LENGTH or micro_batch_size != 1:
        options += f" --seq-length {MODEL['seq_length']} --micro-batch-size {micro_batch_size}"
    ranks_on = f"{ranks} NCCL ranks on as many GPUs" if device != "cpu" else f"{ranks} gloo ranks with 1 thread each"
    return (
        f"{SECTION}\n\n`python benchmarks/train_ckpt_bench.py --every {every} --checkpoints {checkpoints} "
        f"--reps {reps}{options}` on {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{ranks_on}. GPT of {MODEL['vocab_size']} vocab x {MODEL['hidden_size']} "
        f"hidden, {MODEL['num_layers']} layers: {state_gib:.2f} GiB of model + optimizer state per rank (DDP, "
        f"replicated), AdamW, micro-batch {micro_batch_size} x {MODEL['seq_length']} tokens per rank. A checkpoint "
        f"every {every} "
        f"steps, {checkpoints} per run; `ckpt_assume_constant_structure`, 2 writer threads per rank, parallel save "
        "(the default, as NeMo's: each rank writes half of the replicated state) unless the row says otherwise. "
        f"Copying the state into preallocated memory takes {copy:.3f} s per rank{new_memory}; the no-checkpoint "
        f"run's median step is {base_step:.3f} s (so N=50 steps are {50 * base_step:.1f} s). Lost per checkpoint: "
        "(training time - that of the no-checkpoint run of the same repetition, the same round of the interleaving) / "
        "checkpoints; step excess: per checkpoint, the saving step and the 3 after it minus 4 x the median of the other"
        " steps up to the next save (within the run, so free of the runs' drift; the no-checkpoint row, at the same "
        "steps, is its noise floor), for the first checkpoint (which allocates the async staging memory) and the later "
        "ones apart; time to commit: from the save's start to the manifest's update; CPU stolen by the host: the "
        "machine's `steal` time (/proc/stat, all CPUs) over the measured steps, less that of the paired no-checkpoint "
        "run, per checkpoint. "
        f"Medians over {reps} repetitions, configurations interleaved.{reference_sentence(lost_by)} {note}\n\n"
        + "\n".join(lines)
        + "\n"
    )


def reference_sentence(lost_by: dict[str, float]) -> str:
    """The async rows' loss against that of the same bytes written by `dd` in the background."""
    reference = lost_by.get(BACKGROUND_WRITE)
    rows = [name for name in lost_by if name.startswith("async")]
    if reference is None or not rows:
        return ""
    ratios = ", ".join(f"{name} {lost_by[name] / reference:.2f}x" for name in rows)
    return (
        f" The same bytes written by `dd` in the background at the same steps ({BACKGROUND_WRITE!r}: no state "
        "dict, no staging copy, no commit, but each block copied from memory by `dd` before it is written) lose "
        f"{reference:.2f} s per write; lost per checkpoint against it: {ratios}."
    )


def main() -> None:
    check_dependencies([], programs=["dd"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints (N)")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints per run")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=MODEL["vocab_size"], help="smaller for a quick try")
    parser.add_argument("--seq-length", type=int, default=MODEL["seq_length"], help="tokens per sample")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="samples per rank and step")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: rank r trains on GPU r")
    parser.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), help=f"default: all ({OVERLAPPED!r} with --device cuda only)"
    )
    parser.add_argument("--note", default="", help="appended to the RESULTS.md section (machine, load)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--raw", type=Path, help="also write every run's measurements to this JSON file")
    parser.add_argument("--from-raw", type=Path, help="report the measurements of an earlier --raw, run nothing")
    args = parser.parse_args()
    if args.every <= AFFECTED_STEPS:
        parser.error(
            f"--every {args.every}: a checkpoint's steps are the saving one and the {AFFECTED_STEPS - 1} after it, "
            f"measured against the steps after those up to the next save; use --every {AFFECTED_STEPS + 1} or more"
        )
    for option in ("checkpoints", "reps", "ranks", "seq_length", "micro_batch_size"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option)}: use 1 or more")
    if not args.from_raw and (error := gpu_ranks_error([args.ranks], args.device)):
        parser.error(error)
    configs = args.configs or [name for name in CONFIGS if name != OVERLAPPED or args.device == "cuda"]
    if OVERLAPPED in configs and args.device == "cpu":
        parser.error(f"--configs {OVERLAPPED!r} differs from 'async' only with --device cuda")
    MODEL["vocab_size"], MODEL["seq_length"] = args.vocab_size, args.seq_length
    names = ["no checkpoint"] + [name for name in configs if name != "no checkpoint"]
    if args.from_raw:
        measured = json.loads(args.from_raw.read_text())
    else:
        measured = run(names, args.ranks, args.every, args.checkpoints, args.reps, args.micro_batch_size, args.device)
    if args.raw:
        args.raw.write_text(json.dumps(measured))
    text = report(
        measured, args.ranks, args.every, args.checkpoints, args.reps, args.note, args.micro_batch_size, args.device
    )
    print(text)
    if not args.no_write:
        write_section(text, REPO / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()

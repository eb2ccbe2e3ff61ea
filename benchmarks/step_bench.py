"""Training step time and memory per rank: `MegatronStrategy`'s sharding strategies against Lightning's own
`FSDPStrategy` (FSDP1) and `ModelParallelStrategy` (FSDP2), on the same model, data and optimizer.

    python benchmarks/step_bench.py [--model small] [--ranks 2] [--steps 20] [--reps 2] [--threads N] [--no-write]

Each strategy trains the GPT for `--steps` steps (after 3 warm-up steps) with a Lightning Trainer on `--ranks`
gloo processes (NCCL on GPUs), global batch 8, AdamW, gradients clipped to norm 1.0 (`GPTModel`'s hook, the same
for every strategy); every strategy runs in fresh processes with the same number of torch threads per rank,
repetitions in rotated order. Step time: batch start to batch end (forward, backward, clipping, optimizer step),
the slowest rank per step, median; CPU time: the same for the process CPU time (all its threads), which a busy
machine disturbs less than wall time. Memory per rank: the parameters, gradients and optimizer state this rank
holds (before the optimizer step), and the peak resident memory the run added (CUDA: peak allocated).
Writes the `## Step time` section of benchmarks/RESULTS.md.
"""

import argparse
import os
import platform
import resource
import statistics
import time
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from results import check_dependencies, free_port, join_process_group, measurement_trainer, write_section
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from nemo_ckpt.data import MockDataModule
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.models.gpt import GPT, TransformerLayer
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params", "lightning_fsdp", "lightning_fsdp2")
NAMES = {
    "no_shard": "MegatronStrategy `no_shard` (DDP)",
    "optim": "MegatronStrategy `optim` (ZeRO-1)",
    "optim_grads": "MegatronStrategy `optim_grads` (FSDP2, no reshard)",
    "optim_grads_params": "MegatronStrategy `optim_grads_params` (FSDP2)",
    "lightning_fsdp": "Lightning `FSDPStrategy` (FSDP1, full shard)",
    "lightning_fsdp2": "Lightning `ModelParallelStrategy` (FSDP2)",
}
GLOBAL_BATCH_SIZE = 8
WARMUP_STEPS = 3
SECTION = "## Step time"


class FSDP2GPTModel(GPTModel):
    """`GPTModel` for Lightning's `ModelParallelStrategy`: `fully_shard` per layer and embedding, then the root."""

    def configure_model(self) -> None:
        if self.module is not None:
            return
        self.module = GPT(self.config)
        mesh = self.device_mesh["data_parallel"]
        for module in self.module.modules():
            if isinstance(module, (TransformerLayer, nn.Embedding)):
                fully_shard(module, mesh=mesh)
        fully_shard(self.module, mesh=mesh, reshard_after_forward=False)


class Run(NamedTuple):
    """One run of one strategy: median step wall and CPU time (s, slowest rank), bytes per rank."""

    time: float
    cpu_time: float
    state_bytes: int
    peak_bytes: int


class Measure(pl.Callback):
    """Step wall and CPU times, and the bytes of parameters, gradients and optimizer state held by this rank."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.state_bytes = 0
        self._start = 0.0
        self._cpu_start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()
        self._cpu_start = time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.cpu_times.append(time.process_time() - self._cpu_start)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.state_bytes or trainer.global_step == 0:  # the optimizer creates its state in the first step
            return
        tensors = [tensor for param in pl_module.parameters() for tensor in (param, param.grad)]
        tensors += [value for state in optimizer.state.values() for value in state.values()]
        storages = {}
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        self.state_bytes = sum(storages.values())


def strategy_and_model(name: str, model_size: str, ranks: int) -> tuple[pl.strategies.Strategy, GPTModel]:
    config = gpt_config(model_size)
    optim = OptimizerConfig(lr=3e-4, clip_grad=1.0)
    if name == "lightning_fsdp":
        strategy = FSDPStrategy(auto_wrap_policy={TransformerLayer, nn.Embedding}, sharding_strategy="FULL_SHARD")
        return strategy, GPTModel(config, optim)
    if name == "lightning_fsdp2":
        return ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1), FSDP2GPTModel(config, optim)
    # overlap_param_gather (prefetching) pays off with GPU streams; on gloo it only adds work
    overlap_param_gather = name != "no_shard" and torch.cuda.is_available()
    ddp = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=name, overlap_grad_reduce=True, overlap_param_gather=overlap_param_gather
    )
    return MegatronStrategy(ddp=ddp), GPTModel(config, optim)


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def default_threads(ranks: int) -> int:
    """Lightning's own choice for processes it launches: the CPU cores shared out over the ranks."""
    return max(1, (os.cpu_count() or 1) // ranks)


def worker(
    rank: int, ranks: int, port: int, name: str, model_size: str, steps: int, threads: int, results: Any
) -> None:
    # Every strategy gets `threads`: Lightning sets the thread count only through its launchers (DDPStrategy,
    # so MegatronStrategy, always has one; ModelParallelStrategy none for processes started outside it, as
    # here), and only where OMP_NUM_THREADS is unset
    cuda = torch.cuda.is_available()
    join_process_group(rank, ranks, port, threads, "nccl" if cuda else "gloo")
    try:
        pl.seed_everything(0, verbose=False)
        strategy, model = strategy_and_model(name, model_size, ranks)
        config = model.config
        data = MockDataModule(
            seq_length=config.seq_length,
            vocab_size=config.vocab_size,
            micro_batch_size=GLOBAL_BATCH_SIZE // ranks,
            global_batch_size=GLOBAL_BATCH_SIZE,
        )
        measure = Measure()
        trainer = measurement_trainer(ranks, strategy, WARMUP_STEPS + steps, [measure], "gpu" if cuda else "cpu")
        rss_before = current_rss_bytes()
        trainer.fit(model, datamodule=data)
        peak = (
            torch.cuda.max_memory_allocated()
            if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        )
        per_rank: list[Any] = [None] * ranks
        dist.all_gather_object(
            per_rank, (measure.times[WARMUP_STEPS:], measure.cpu_times[WARMUP_STEPS:], measure.state_bytes, peak)
        )
        if rank == 0:
            slowest = [max(step) for step in zip(*(times for times, _, _, _ in per_rank))]
            slowest_cpu = [max(step) for step in zip(*(cpu for _, cpu, _, _ in per_rank))]
            results[name] = (
                statistics.median(slowest),
                statistics.median(slowest_cpu),
                max(b for _, _, b, _ in per_rank),
                max(p for _, _, _, p in per_rank),
            )
    finally:
        dist.destroy_process_group()


def available_strategies() -> tuple[str, ...]:
    """Lightning's `FSDPStrategy` refuses the CPU accelerator: it runs on GPUs only."""
    return STRATEGIES if torch.cuda.is_available() else tuple(s for s in STRATEGIES if s != "lightning_fsdp")


def run(model_size: str, ranks: int, steps: int, reps: int, threads: int) -> dict[str, list[Run]]:
    """Per strategy, one `Run` per repetition; each repetition runs every strategy, in rotated order."""
    names = available_strategies()
    measured: dict[str, list[Run]] = {name: [] for name in names}
    with mp.Manager() as manager:
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                results = manager.dict()
                mp.spawn(worker, args=(ranks, free_port(), name, model_size, steps, threads, results), nprocs=ranks)
                measured[name].append(Run(*results[name]))
                print(
                    f"{name}: {measured[name][-1].time * 1e3:.1f} ms/step, "
                    f"{measured[name][-1].cpu_time * 1e3:.1f} ms CPU",
                    flush=True,
                )
    return measured


def report(measured: dict[str, list[Run]], model_size: str, ranks: int, steps: int, reps: int, threads: int) -> str:
    config = gpt_config(model_size)
    median_time = {name: statistics.median(run.time for run in runs) for name, runs in measured.items()}
    median_cpu = {name: statistics.median(run.cpu_time for run in runs) for name, runs in measured.items()}
    lightning = [name for name in ("lightning_fsdp", "lightning_fsdp2") if name in measured]
    baseline = min(median_time[name] for name in lightning)
    baseline_cpu = min(median_cpu[name] for name in lightning)
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else (f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), gloo")
    )
    lines = [
        SECTION,
        "",
        (
            f"`python benchmarks/step_bench.py --model {model_size} --ranks {ranks} --steps {steps} --reps {reps} "
            f"--threads {threads}` on {device}, torch {torch.__version__}, {ranks} ranks with {threads} torch "
            f"thread(s) each (every strategy). Model `{model_size}` ({config.num_parameters() / 1e6:.1f}M "
            f"parameters, seq {config.seq_length}), global batch {GLOBAL_BATCH_SIZE}, AdamW, gradients clipped to "
            "norm 1.0 (the same `GPTModel` hook on every strategy); MegatronStrategy with `overlap_grad_reduce` and, "
            "on GPUs when sharded, `overlap_param_gather`; Lightning's FSDP2 sharded as `optim_grads_params` (each "
            "layer and the embedding a unit, resharded after forward; the root kept gathered). Step time: slowest "
            "rank, median of the steps after 3 warm-up steps, median over "
            f"{reps} repetitions in rotated order (range in brackets). CPU time: the same for the process CPU time "
            "per step. Model state: parameters + gradients + optimizer state held per rank. Peak: resident memory "
            "added during `fit` per rank (max over ranks)."
        ),
        "",
        (
            "| strategy | step time (ms) | vs best Lightning | CPU time / step (ms) | vs best Lightning | "
            "model state / rank (MB) | peak added / rank (MB) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in measured.items():
        times = [run.time for run in runs]
        state = max(run.state_bytes for run in runs)
        peak = statistics.median(run.peak_bytes for run in runs)
        lines.append(
            f"| {NAMES[name]} | {median_time[name] * 1e3:.1f} ({min(times) * 1e3:.1f}–"
            f"{max(times) * 1e3:.1f}) | {median_time[name] / baseline:.2f}x | {median_cpu[name] * 1e3:.1f} | "
            f"{median_cpu[name] / baseline_cpu:.2f}x | {state / 2**20:.1f} | {peak / 2**20:.1f} |"
        )
    if "lightning_fsdp" not in measured:
        lines += ["", "Lightning's `FSDPStrategy` is not in the table: it refuses the CPU accelerator (GPU only)."]
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    check_dependencies(["lightning"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank, for every strategy (default: CPU cores / ranks)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the table without writing RESULTS.md")
    args = parser.parse_args()
    threads = args.threads or default_threads(args.ranks)
    section = report(
        run(args.model, args.ranks, args.steps, args.reps, threads),
        args.model,
        args.ranks,
        args.steps,
        args.reps,
        threads,
    )
    print(section)
    if not args.no_write:
        write_section(section)


if __name__ == "__main__":
    main()

"""Pipeline parallelism: step time, pipeline bubble and activation memory per stage (1F1B and interleaved 1F1B)
against FSDP2 on the same processes.

    python benchmarks/pp_bench.py [--model small] [--num-layers 8] [--seq-length 64] [--batches 8,16] [--steps 4]
        [--reps 3] [--no-write]

Each layout trains the same GPT (`--model` with `--num-layers` layers) with `MegatronStrategy` under a Lightning
Trainer (gloo, CPU, 1 torch thread per process) on global batches of `--batches` sequences. On 4 processes: PP=4
1F1B, PP=4 V=2 (interleaved 1F1B), PP=2 x DP=2 (1F1B, gradients all-reduced over dp after the schedule) and FSDP2
(`data_parallel_sharding_strategy='optim_grads_params'`, DP=4). On 2 processes: PP=2 1F1B, PP=2 V=2 and FSDP2
DP=2. Pipelines run micro-batches of 1 sequence, so m = batch / dp micro-batches per step; FSDP2 gives each rank
batch / dp sequences in one micro-batch.

Measured, after `WARMUP_STEPS` warm-up steps, `--steps` steps per run, `--reps` repetitions with the layouts in
rotated order, medians:
- step time: Lightning's batch start to batch end (schedule or forward/backward, gradient reduction, clipping,
  AdamW), the slowest rank;
- bubble: per pipeline rank, the fraction of the pipeline step in which it does not compute. Compute is the wall
  time inside its stages' `PipelineStage.forward_one_chunk` and `backward_one_chunk` (the schedules' forward and
  backward of one micro-batch: the stage module's forward, autograd backward) and the last stage's loss; the
  pipeline step runs from the first rank entering the schedule's `step` to the last rank leaving it (clocks are
  the machine's monotonic clock, shared by the processes). The rest is waiting for P2P receives and sends
  (`get_*_recv_ops` / `get_*_send_ops`) and the schedules' own bookkeeping. Theory: (P-1)/(m+P-1) for 1F1B and
  (P-1)/(V*m+P-1) interleaved, which assume equal stage times and free communication;
- activation memory: per rank, the peak bytes autograd holds for backward during a step (the storages of saved
  tensors, each once, live at the same time; parameters and their views excluded), through
  `torch.autograd.graph.saved_tensors_hooks`.

Writes `## Pipeline parallelism` in benchmarks/RESULTS.md and `pp_bubble.png` beside it.
"""

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results import RESULTS, check_dependencies, free_port, join_process_group, measurement_trainer, write_section
from torch import nn

from nemo_ckpt.data import MockDataModule
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.models.gpt import GPTConfig
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy

SECTION = "## Pipeline parallelism"
PLOT = RESULTS.parent / "pp_bubble.png"
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Layout:
    """A parallel layout on `world` processes: `pp` pipeline ranks with `vpp` virtual stages each, or FSDP2
    over all processes (pp=1)."""

    world: int
    pp: int = 1
    vpp: int | None = None

    @property
    def dp(self) -> int:
        return self.world // self.pp

    @property
    def virtual(self) -> int:
        return self.vpp or 1

    @property
    def name(self) -> str:
        if self.pp == 1:
            return f"FSDP2 DP={self.dp}"
        schedule = f"V={self.vpp} interleaved" if self.vpp else "1F1B"
        return f"PP={self.pp}{f' x DP={self.dp}' if self.dp > 1 else ''} {schedule}"

    def microbatches(self, batch: int) -> int:
        """Micro-batches per step and pipeline (pipelines run micro-batches of one sequence)."""
        return batch // self.dp if self.pp > 1 else 1

    def theoretical_bubble(self, batch: int) -> float:
        return (self.pp - 1) / (self.virtual * self.microbatches(batch) + self.pp - 1)


LAYOUTS = (
    Layout(4, pp=4),
    Layout(4, pp=4, vpp=2),
    Layout(4, pp=2),
    Layout(4),
    Layout(2, pp=2),
    Layout(2, pp=2, vpp=2),
    Layout(2),
)


class Measured(NamedTuple):
    """One run: step time (s, slowest rank), and per pipeline rank the idle fraction (None without a pipeline)
    and the peak activation bytes (max over data-parallel replicas)."""

    step_time: float
    bubble: list[float] | None
    activation_bytes: list[int]


class ComputeClock:
    """Wall seconds spent inside the wrapped calls since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


class TimedGPTModel(GPTModel):
    """`GPTModel` whose last-stage loss counts as compute on `clock` (set before `fit`)."""

    clock: ComputeClock

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.clock.wrap(super().pipeline_loss)(logits, targets)


class PipelineTimer(pl.Callback):
    """Per pipeline step: (start, end, compute seconds) of this rank, from the strategy's `PipelineRunner`
    (`strategy.parallel.pipeline`): its stages' forward and backward chunks and its schedule's `step` are wrapped."""

    def __init__(self, clock: ComputeClock) -> None:
        self.clock = clock
        self.windows: list[tuple[float, float, float]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runner = trainer.strategy.parallel.pipeline
        for stage in runner.stages:
            stage.forward_one_chunk = self.clock.wrap(stage.forward_one_chunk)
            stage.backward_one_chunk = self.clock.wrap(stage.backward_one_chunk)
        step = runner.schedule.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            self.clock.seconds = 0.0
            start = time.perf_counter()
            result = step(*args, **kwargs)
            self.windows.append((start, time.perf_counter(), self.clock.seconds))
            return result

        runner.schedule.step = timed_step


class SavedTensor:
    """A tensor autograd saved for backward, counted in `owner` while autograd holds it."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, tensor: torch.Tensor, owner: "SavedActivations") -> None:
        self.tensor, self.owner = tensor, owner
        storage = tensor.untyped_storage()
        self.key = storage.data_ptr()
        owner.hold(self.key, storage.nbytes())

    def __del__(self) -> None:
        self.owner.release(self.key)


class SavedActivations(pl.Callback):
    """Peak bytes of the storages autograd holds for backward during each training step, above what it held at
    the step's start: saved tensors, each storage once, parameters (and views of them) excluded."""

    def __init__(self) -> None:
        self.held: dict[int, list[int]] = {}  # storage pointer -> [saved tensors holding it, bytes]
        self.current = 0
        self.peak = 0
        self._start = 0
        self.peaks: list[int] = []
        self._hooks: AbstractContextManager | None = None

    def hold(self, key: int, nbytes: int) -> None:
        entry = self.held.setdefault(key, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def release(self, key: int) -> None:
        entry = self.held[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.held[key]

    def pack(self, tensor: torch.Tensor) -> Any:
        base = tensor if tensor._base is None else tensor._base
        return tensor if isinstance(base, nn.Parameter) else SavedTensor(tensor, self)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, SavedTensor) else saved

    def on_train_batch_start(self, *args: Any) -> None:
        self._start, self.peak = self.current, self.current
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self._hooks.__exit__(None, None, None)
        self.peaks.append(self.peak - self._start)


class StepTimer(pl.Callback):
    """Wall time from batch start to batch end of every step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def train(layout: Layout, batch: int, config: GPTConfig, steps: int) -> dict[str, Any]:
    """Train `steps` steps after the warm-up; this rank's coordinates and measurements."""
    pl.seed_everything(0, verbose=False)
    sharding = "no_shard" if layout.pp > 1 else "optim_grads_params"
    strategy = MegatronStrategy(
        ddp=DistributedDataParallelConfig(data_parallel_sharding_strategy=sharding),
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
    )
    clock = ComputeClock()
    model = TimedGPTModel(config, OptimizerConfig(lr=3e-4))
    model.clock = clock
    step_timer, activations = StepTimer(), SavedActivations()
    callbacks: list[pl.Callback] = [step_timer, activations]
    pipeline_timer = PipelineTimer(clock) if layout.pp > 1 else None
    if pipeline_timer is not None:
        callbacks.append(pipeline_timer)
    data = MockDataModule(
        seq_length=config.seq_length,
        vocab_size=config.vocab_size,
        micro_batch_size=1 if layout.pp > 1 else batch // layout.dp,
        global_batch_size=batch,
    )
    trainer = measurement_trainer(layout.world, strategy, WARMUP_STEPS + steps, callbacks)
    trainer.fit(model, datamodule=data)
    return {
        "pp_rank": strategy.parallel_dims.pp_mesh.get_local_rank(),
        "dp_rank": strategy.parallel_dims.dp_rank,
        "step_times": step_timer.times[WARMUP_STEPS:],
        "windows": pipeline_timer.windows[WARMUP_STEPS:] if pipeline_timer else [],
        "activation_bytes": max(activations.peaks[WARMUP_STEPS:]),
    }


def summarize(layout: Layout, per_rank: list[dict[str, Any]]) -> Measured:
    """The slowest rank's median step time; per pipeline rank the median idle fraction (averaged over the
    data-parallel replicas) and the peak activation bytes (max over them)."""
    step_time = statistics.median(max(step) for step in zip(*(rank["step_times"] for rank in per_rank)))
    activation_bytes = [
        max(rank["activation_bytes"] for rank in per_rank if rank["pp_rank"] == pp_rank) for pp_rank in range(layout.pp)
    ]
    if layout.pp == 1:
        return Measured(step_time, None, activation_bytes)
    idle: dict[int, list[float]] = {pp_rank: [] for pp_rank in range(layout.pp)}
    for dp_rank in range(layout.dp):
        pipeline = sorted((rank for rank in per_rank if rank["dp_rank"] == dp_rank), key=lambda r: r["pp_rank"])
        for step_windows in zip(*(rank["windows"] for rank in pipeline)):
            span = max(end for _, end, _ in step_windows) - min(start for start, _, _ in step_windows)
            for pp_rank, (_, _, compute) in enumerate(step_windows):
                idle[pp_rank].append(1.0 - compute / span)
    return Measured(step_time, [statistics.median(idle[pp_rank]) for pp_rank in range(layout.pp)], activation_bytes)


def worker(
    rank: int, world: int, port: int, cases: list[tuple[Layout, int]], config: GPTConfig, steps: int, reps: int, results
) -> None:
    join_process_group(rank, world, port)
    try:
        for rep in range(reps):
            for layout, batch in cases[rep % len(cases) :] + cases[: rep % len(cases)]:
                measured = train(layout, batch, config, steps)
                per_rank: list[Any] = [None] * world
                dist.all_gather_object(per_rank, measured)
                if rank == 0:
                    summary = summarize(layout, per_rank)
                    results[(LAYOUTS.index(layout), batch, rep)] = tuple(summary)
                    print(f"{layout.name}, batch {batch}, rep {rep}: {summary}", flush=True)
    finally:
        dist.destroy_process_group()


def run(config: GPTConfig, batches: list[int], steps: int, reps: int) -> dict[tuple[Layout, int], list[Measured]]:
    """Per (layout, batch), one `Measured` per repetition: one group of processes per world size."""
    measured: dict[tuple[Layout, int], list[Measured]] = {}
    with mp.Manager() as manager:
        for world in sorted({layout.world for layout in LAYOUTS}, reverse=True):
            cases = [(layout, batch) for layout in LAYOUTS if layout.world == world for batch in batches]
            results = manager.dict()
            mp.spawn(worker, args=(world, free_port(), cases, config, steps, reps, results), nprocs=world)
            for layout, batch in cases:
                index = LAYOUTS.index(layout)
                measured[(layout, batch)] = [Measured(*results[(index, batch, rep)]) for rep in range(reps)]
    return measured


def median_bubble(runs: list[Measured]) -> list[float]:
    return [statistics.median(run.bubble[stage] for run in runs) for stage in range(len(runs[0].bubble))]


def median_activations(runs: list[Measured]) -> list[float]:
    return [
        statistics.median(run.activation_bytes[stage] for run in runs) for stage in range(len(runs[0].activation_bytes))
    ]


def plot(measured: dict[tuple[Layout, int], list[Measured]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(layout, batch) for (layout, batch) in measured if layout.pp > 1]
    figure, axis = plt.subplots(figsize=(11, 5))
    positions = range(len(rows))
    theory = [layout.theoretical_bubble(batch) for layout, batch in rows]
    mean_measured = [statistics.mean(median_bubble(measured[row])) for row in rows]
    axis.bar([p - 0.2 for p in positions], theory, width=0.4, label="theory (P-1)/(V*m+P-1)", color="tab:gray")
    axis.bar([p + 0.2 for p in positions], mean_measured, width=0.4, label="measured, mean of stages", color="tab:blue")
    for position, row in zip(positions, rows):
        stages = median_bubble(measured[row])
        axis.plot([position + 0.2] * len(stages), stages, "k.", markersize=5)
    axis.plot([], [], "k.", label="measured, each stage")
    labels = [
        "\n".join([*layout.name.split(" "), f"m={layout.microbatches(batch)}, {layout.world} proc"])
        for layout, batch in rows
    ]
    axis.set_xticks(list(positions), labels, fontsize=7)
    axis.set(ylabel="idle fraction of the pipeline step", title="Pipeline bubble: measured vs theory")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def report(
    measured: dict[tuple[Layout, int], list[Measured]],
    config: GPTConfig,
    command: str,
    steps: int,
    reps: int,
    load_averages: tuple[float, float],
) -> str:
    lines = [
        SECTION,
        "",
        f"`{command}` on {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch "
        f"{torch.__version__}, gloo, 1 torch thread per process. Model: {config.num_layers} layers, hidden "
        f"{config.hidden_size}, seq {config.seq_length}, vocab {config.vocab_size} "
        f"({config.num_parameters() / 1e6:.1f}M parameters), AdamW, gradients clipped to 1.0. Pipelines run "
        "micro-batches of 1 sequence (m = batch / dp per step; PP rows reduce gradients over dp as DDP, after the "
        "schedule); FSDP2 is `optim_grads_params`, batch / dp sequences per rank. Step: batch start to end, slowest "
        f"rank, median of {steps} steps after {WARMUP_STEPS} warm-up steps, median of {reps} repetitions in rotated "
        "order. Bubble: per pipeline rank, the fraction of the pipeline step (first rank entering the schedule to "
        "the last leaving it) outside its stages' forward/backward chunks and the loss, stages listed first to last "
        "(`pp_bench.py`'s docstring says what is timed). Activations: peak bytes autograd holds for backward per "
        "rank (saved tensors, parameters excluded), stages first to last. 1-minute load average "
        f"{load_averages[0]:.1f} at the start, {load_averages[1]:.1f} at the end (the machine is shared).",
        "",
        "| layout | processes | batch | m | step (ms) | vs FSDP2 | bubble theory | bubble measured (mean) | "
        "bubble per stage | activations per stage (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (layout, batch), runs in measured.items():
        step = statistics.median(run.step_time for run in runs)
        fsdp = statistics.median(run.step_time for run in measured[(Layout(layout.world), batch)])
        memory = " / ".join(f"{value / 2**20:.2f}" for value in median_activations(runs))
        if layout.pp > 1:
            stages = median_bubble(runs)
            theory = f"{layout.theoretical_bubble(batch):.2f}"
            bubble, per_stage = f"{statistics.mean(stages):.2f}", " / ".join(f"{value:.2f}" for value in stages)
            m = str(layout.microbatches(batch))
        else:
            theory = bubble = per_stage = m = "-"
        lines.append(
            f"| {layout.name} | {layout.world} | {batch} | {m} | {step * 1e3:.0f} | {step / fsdp:.2f}x | {theory} | "
            f"{bubble} | {per_stage} | {memory} |"
        )
    ratios = {world: bubble_ratios(measured, world) for world in (2, 4)}
    lines += [
        "",
        f"![pipeline bubble, measured vs theory]({PLOT.name})",
        "",
        "The 2-process rows are the honest comparison with theory: one process per core. The 4-process rows "
        "oversubscribe the 2 cores 2x, so a rank computes at about half speed while the others compute and gets "
        "a whole core while they wait: its idle time is stretched and shifted, and the idle fraction measured there "
        "is not a hardware bubble (nor a wasted core: another rank runs meanwhile). Measured / theory, per row: "
        f"{ratios[2]} on 2 processes, {ratios[4]} on 4. Above the theory even on 2 processes: the theory assumes "
        "equal stages and free communication, while here the first stage also embeds and the last runs the output "
        "layer and the loss, each gloo send/receive and the schedule's bookkeeping cost a sizeable fraction of one "
        "micro-batch's compute (a sequence of "
        f"{config.seq_length} tokens through a stage's layers), and other engineers' jobs share the cores. Those "
        "costs come with every micro-batch, so the measured fraction falls more slowly with m than the theory's. "
        f"Interleaved 1F1B takes {interleaved_step_ratios(measured)} of 1F1B's step time (same P, processes and "
        "batch); its price is activation memory: with 1F1B "
        "pipeline rank r holds at most P - r micro-batches' activations (the warm-up forwards; the last rank's "
        "also hold the logits), and with V virtual stages more forwards are in flight per rank. FSDP2 "
        "holds its whole batch / dp through every layer and all-gathers every layer's weights in forward and in "
        "backward (reduce-scattering the gradients) over gloo each step, where a pipeline sends only one "
        "micro-batch's hidden states per stage boundary.",
        "",
    ]
    return "\n".join(lines)


def interleaved_step_ratios(measured: dict[tuple[Layout, int], list[Measured]]) -> str:
    """Step time of each interleaved row over its 1F1B row (same processes, P and batch), as a range."""
    ratios = [
        statistics.median(run.step_time for run in runs)
        / statistics.median(run.step_time for run in measured[(Layout(layout.world, layout.pp), batch)])
        for (layout, batch), runs in measured.items()
        if layout.vpp and (Layout(layout.world, layout.pp), batch) in measured
    ]
    return f"{min(ratios):.2f}x to {max(ratios):.2f}x" if ratios else "(not measured)"


def bubble_ratios(measured: dict[tuple[Layout, int], list[Measured]], world: int) -> str:
    """Measured mean bubble / theory of the pipeline rows on `world` processes, as a range."""
    ratios = [
        statistics.mean(median_bubble(runs)) / layout.theoretical_bubble(batch)
        for (layout, batch), runs in measured.items()
        if layout.world == world and layout.pp > 1
    ]
    return f"{min(ratios):.1f}x to {max(ratios):.1f}x" if ratios else "not measured"


def main() -> None:
    check_dependencies(["torch", "lightning", "matplotlib"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batches", default="8,16", help="global batch sizes (sequences per step)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the section without writing RESULTS.md")
    args = parser.parse_args()
    config = gpt_config(args.model, num_layers=args.num_layers, seq_length=args.seq_length)
    batches = [int(batch) for batch in args.batches.split(",")]
    command = (
        f"python benchmarks/pp_bench.py --model {args.model} --num-layers {args.num_layers} --seq-length "
        f"{args.seq_length} --batches {args.batches} --steps {args.steps} --reps {args.reps}"
    )
    load_before = os.getloadavg()[0]
    measured = run(config, batches, args.steps, args.reps)
    section = report(measured, config, command, args.steps, args.reps, (load_before, os.getloadavg()[0]))
    print(section)
    if not args.no_write:
        plot(measured, PLOT)
        write_section(section)


if __name__ == "__main__":
    main()

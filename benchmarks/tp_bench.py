"""Training step time: tensor parallelism (TP=2, with and without sequence parallelism) against FSDP, 2 ranks.

    python benchmarks/tp_bench.py [--model small] [--steps 20] [--reps 3] [--threads 1] [--no-write]

Each layout trains the same GPT on the same global batch (8 sequences) with AdamW on 2 gloo ranks (CPU):
`fsdp`: `fully_shard` per layer over dp=2, each rank a micro-batch of 4; `tp2`: TP=2, both ranks on all
8 sequences; `tp2_sp`: TP=2 with sequence parallelism. A step is forward, backward, clip and optimizer step;
its time is the slowest rank's, between barriers, median over the steps after 3 warm-up steps. Repetitions
run the layouts in rotated order. Writes `## Tensor parallelism` in benchmarks/RESULTS.md.
"""

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from results import check_dependencies, free_port, write_section
from torch.distributed.fsdp import fully_shard

from nemo_ckpt.models.gpt import GPT, gpt_config, parallelize_gpt
from nemo_ckpt.parallel.mesh import build_device_mesh

LAYOUTS = ("fsdp", "tp2", "tp2_sp")
GLOBAL_BATCH_SIZE = 8
WARMUP_STEPS = 3
SECTION = "## Tensor parallelism"


def build(layout: str, model_size: str) -> tuple[GPT, int, int]:
    config = gpt_config(model_size)
    torch.manual_seed(0)
    model = GPT(config)
    mesh = build_device_mesh("cpu", 1 if layout == "fsdp" else 2)
    if layout == "fsdp":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        parallelize_gpt(model, mesh["tp"], sequence_parallel=layout == "tp2_sp")
    return model, mesh["dp"].get_local_rank(), mesh["dp"].size()


def step_times(layout: str, model_size: str, steps: int) -> list[float]:
    model, dp_rank, dp_size = build(layout, model_size)
    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    micro = GLOBAL_BATCH_SIZE // dp_size
    times = []
    for _ in range(WARMUP_STEPS + steps):
        tokens = torch.randint(config.vocab_size, (GLOBAL_BATCH_SIZE, config.seq_length + 1), generator=generator)
        tokens = tokens[dp_rank * micro : (dp_rank + 1) * micro]
        dist.barrier()
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return times[WARMUP_STEPS:]


def worker(rank: int, port: int, layouts: list[str], model_size: str, steps: int, threads: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for layout in layouts:
            times = step_times(layout, model_size, steps)
            if rank == 0:
                results[layout] = times
    finally:
        dist.destroy_process_group()


def run(model_size: str, steps: int, reps: int, threads: int) -> dict[str, list[float]]:
    """Per layout, the median step time of each repetition (seconds)."""
    medians: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    with mp.Manager() as manager:
        for rep in range(reps):
            order = list(LAYOUTS[rep % len(LAYOUTS) :] + LAYOUTS[: rep % len(LAYOUTS)])
            results = manager.dict()
            mp.spawn(worker, args=(free_port(), order, model_size, steps, threads, results), nprocs=2, join=True)
            for layout in LAYOUTS:
                medians[layout].append(statistics.median(results[layout]))
    return medians


def report(
    medians: dict[str, list[float]], model_size: str, steps: int, reps: int, threads: int, load_average: float
) -> str:
    config = gpt_config(model_size)
    baseline = statistics.median(medians["fsdp"])
    names = {"fsdp": "FSDP (`fully_shard`, dp=2)", "tp2": "TP=2", "tp2_sp": "TP=2 + sequence parallel"}
    lines = [
        SECTION,
        "",
        f"`python benchmarks/tp_bench.py --model {model_size} --steps {steps} --reps {reps} --threads {threads}` "
        f"on {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"2 gloo ranks with {threads} thread(s) each. Model `{model_size}` ({config.num_parameters() / 1e6:.1f}M "
        f"parameters, seq {config.seq_length}), global batch {GLOBAL_BATCH_SIZE}, AdamW. Step = forward, backward, "
        "clip, optimizer step; slowest rank; median of "
        f"{steps} steps per repetition; the range is over {reps} repetitions. The machine is shared: 1-minute "
        f"load average {load_average:.1f} when the run started.",
        "",
        "| layout | step time (ms) | range (ms) | vs FSDP |",
        "|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        median = statistics.median(medians[layout])
        lines.append(
            f"| {names[layout]} | {median * 1e3:.1f} | {min(medians[layout]) * 1e3:.1f}–"
            f"{max(medians[layout]) * 1e3:.1f} | {median / baseline:.2f}x |"
        )
    lines += [
        "",
        "Communication per step: FSDP all-gathers each layer's weights (forward and backward) and "
        "reduce-scatters its gradients; TP=2 all-reduces activations after each attention and MLP block "
        "(forward and backward) and, with sequence parallelism, all-gathers and reduce-scatters them instead, "
        "running norms and residuals on half the sequence. All collectives block on gloo; on GPUs they overlap "
        "with GEMMs (`tp_comm_overlap`, nemo_ckpt/strategy/comm_overlap.py).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    check_dependencies(["torch"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print the section without writing RESULTS.md")
    args = parser.parse_args()
    load_average = os.getloadavg()[0]
    medians = run(args.model, args.steps, args.reps, args.threads)
    section = report(medians, args.model, args.steps, args.reps, args.threads, load_average)
    print(section)
    if not args.no_write:
        write_section(section)


if __name__ == "__main__":
    main()

"""Mixture of experts on 2 gloo ranks: step time of expert parallelism (EP=2) against replicated experts (EP=1),
all-to-all volume against the theoretical one, and load balance with and without the aux loss.

    python benchmarks/moe_bench.py [--model small_moe] [--steps 20] [--reps 3] [--balance-steps 100] [--no-write]

Step time: the same MoE GPT and global batch (8 sequences, 4 per rank) with AdamW; `ep1`: every rank holds all
experts, gradients averaged over both ranks; `ep2`: each rank holds half of them, tokens travel by all-to-all. A
step is forward, backward, gradient reduction, clip and optimizer step; the slowest rank's time between
barriers, median over the steps after 3 warm-up steps; repetitions alternate the order. All-to-all volume: the
rows each rank sends to the other rank (dispatch and combine, forward and backward) per step, in MB, against
the volume if routing were uniform (tokens x top-k x (ep-1)/ep x hidden x 4 bytes x 4 transfers per MoE layer).
Load balance: `tiny_moe` trained with EP=2 for `--balance-steps` steps on Zipf-distributed tokens, with
`moe_aux_loss_coeff` 1e-2 and 0; imbalance = most tokens any expert gets / the mean, per layer and step.
Writes `## Mixture of experts` in benchmarks/RESULTS.md and moe_balance.png beside it.
"""

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from results import check_dependencies, free_port, write_section

from nemo_ckpt.models.gpt import GPT, gpt_config
from nemo_ckpt.models.gpt.moe import MoELayer, expert_parallel_group
from nemo_ckpt.parallel import expert_parallel
from nemo_ckpt.parallel.expert_parallel import (
    ExpertParallelGradReducer,
    apply_expert_parallel,
    clip_grad_norm_expert_parallel,
)
from nemo_ckpt.parallel.mesh import ParallelDims

LAYOUTS = ("ep1", "ep2")
WORLD_SIZE = 2
GLOBAL_BATCH_SIZE = 8
WARMUP_STEPS = 3
SECTION = "## Mixture of experts"
PLOT = Path(__file__).resolve().parent / "moe_balance.png"


class SentRows:
    """Counts the bytes this rank sends to other ranks through `expert_parallel.all_to_all`."""

    def __init__(self) -> None:
        self.bytes = 0
        self.original = expert_parallel.all_to_all

    def __enter__(self) -> "SentRows":
        def counting(tokens, output_splits, input_splits, group):
            own = dist.get_group_rank(group, dist.get_rank())
            remote_rows = sum(rows for rank, rows in enumerate(input_splits) if rank != own)
            self.bytes += remote_rows * tokens[0].numel() * tokens.element_size()
            return self.original(tokens, output_splits, input_splits, group)

        expert_parallel.all_to_all = counting
        return self

    def __exit__(self, *exc) -> None:
        expert_parallel.all_to_all = self.original


def build(layout: str, config) -> tuple[GPT, ExpertParallelGradReducer]:
    torch.manual_seed(0)
    model = GPT(config)
    ep = 2 if layout == "ep2" else 1
    expert_mesh = ParallelDims(WORLD_SIZE, ep=ep).build_expert_mesh("cpu")
    apply_expert_parallel(model, expert_mesh if ep > 1 else None, dist.group.WORLD)
    return model, ExpertParallelGradReducer(model, dist.group.WORLD, expert_mesh["edp"].get_group())


def train_step(model: GPT, reducer: ExpertParallelGradReducer, optimizer, tokens: torch.Tensor) -> None:
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    reducer.finish()
    group = expert_parallel_group(model)
    if group is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:
        clip_grad_norm_expert_parallel(model.named_parameters(), 1.0, group)
    optimizer.step()
    optimizer.zero_grad()


def zipf_tokens(config, generator: torch.Generator) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, config.vocab_size + 1).float()
    samples = torch.multinomial(weights, GLOBAL_BATCH_SIZE * (config.seq_length + 1), True, generator=generator)
    return samples.view(GLOBAL_BATCH_SIZE, -1)


def step_times(layout: str, model_size: str, steps: int) -> tuple[list[float], float]:
    """Step times (s) and the mean all-to-all MB sent to the other rank per step."""
    config = gpt_config(model_size)
    model, reducer = build(layout, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    micro = GLOBAL_BATCH_SIZE // WORLD_SIZE
    rank = dist.get_rank()
    times = []
    with SentRows() as sent:
        for step in range(WARMUP_STEPS + steps):
            if step == WARMUP_STEPS:
                sent.bytes = 0
            tokens = zipf_tokens(config, generator)[rank * micro : (rank + 1) * micro]
            dist.barrier()
            start = time.perf_counter()
            train_step(model, reducer, optimizer, tokens)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
    return times[WARMUP_STEPS:], sent.bytes / steps / 1e6


def imbalance(model: GPT) -> float:
    """Most tokens an expert got / the mean, the worst MoE layer of the last forward (over both ranks)."""
    counts = [m.last_metrics["tokens_per_expert"] for m in model.modules() if isinstance(m, MoELayer)]
    return max((count.max() / count.mean()).item() for count in counts)


def balance(aux_loss_coeff: float, steps: int) -> list[float]:
    config = gpt_config("tiny_moe", moe_aux_loss_coeff=aux_loss_coeff)
    model, reducer = build("ep2", config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    micro = GLOBAL_BATCH_SIZE // WORLD_SIZE
    rank = dist.get_rank()
    history = []
    for _ in range(steps):
        tokens = zipf_tokens(config, generator)[rank * micro : (rank + 1) * micro]
        train_step(model, reducer, optimizer, tokens)
        history.append(imbalance(model))
    return history


def worker(rank: int, port: int, order: list[str], args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        for task in order:
            if task in LAYOUTS:
                result = step_times(task, args.model, args.steps)
            else:
                result = balance(float(task.split("=")[1]), args.balance_steps)
            if rank == 0:
                results[task] = result
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    measured: dict = {layout: [] for layout in LAYOUTS}
    with mp.Manager() as manager:
        for rep in range(args.reps):
            order = list(LAYOUTS if rep % 2 == 0 else reversed(LAYOUTS))
            if rep == 0:
                order += ["aux=0.01", "aux=0.0"]
            results = manager.dict()
            mp.spawn(worker, args=(free_port(), order, args, results), nprocs=WORLD_SIZE, join=True)
            for layout in LAYOUTS:
                times, megabytes = results[layout]
                measured[layout].append((statistics.median(times), megabytes))
            if rep == 0:
                measured["balance"] = {coeff: results[f"aux={coeff}"] for coeff in ("0.01", "0.0")}
    return measured


def uniform_megabytes(model_size: str) -> float:
    """All-to-all MB one rank sends the other per step if every expert got the same share of tokens."""
    config = gpt_config(model_size)
    moe_layers = sum(isinstance(layer.mlp, MoELayer) for layer in GPT(config).layers)
    tokens = GLOBAL_BATCH_SIZE // WORLD_SIZE * config.seq_length
    rows = tokens * config.moe_router_topk * (WORLD_SIZE - 1) / WORLD_SIZE
    return rows * config.hidden_size * 4 * 4 * moe_layers / 1e6


def plot(balance_history: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for coeff, history in balance_history.items():
        axes.plot(range(1, len(history) + 1), history, label=f"moe_aux_loss_coeff={coeff}")
    axes.axhline(1.0, color="gray", linewidth=0.5)
    axes.set_xlabel("step")
    axes.set_ylabel("max / mean tokens per expert")
    axes.set_title("tiny_moe, EP=2, 2 ranks: load balance")
    axes.legend()
    figure.tight_layout()
    figure.savefig(PLOT, dpi=100)


def report(measured: dict, args: argparse.Namespace, load_average: float) -> str:
    config = gpt_config(args.model)
    baseline = statistics.median(t for t, _ in measured["ep1"])
    names = {"ep1": "EP=1 (experts replicated, gradients all-reduced)", "ep2": "EP=2 (all-to-all dispatch)"}
    lines = [
        SECTION,
        "",
        f"`python benchmarks/moe_bench.py --model {args.model} --steps {args.steps} --reps {args.reps} "
        f"--balance-steps {args.balance_steps} --threads {args.threads}` on {os.cpu_count()} CPU cores "
        f"({platform.processor() or platform.machine()}), torch {torch.__version__}, 2 gloo ranks with "
        f"{args.threads} thread(s) each. Model `{args.model}` ({config.num_parameters() / 1e6:.1f}M parameters, "
        f"{config.num_moe_experts} experts, top-{config.moe_router_topk}, seq {config.seq_length}), global batch "
        f"{GLOBAL_BATCH_SIZE} of Zipf-distributed tokens, AdamW. Step = forward, backward, gradient reduction, clip, "
        f"optimizer step; slowest rank; median of {args.steps} steps per repetition, range over {args.reps} "
        "repetitions. The machine is shared with other engineers' jobs: 1-minute load average "
        f"{load_average:.1f} when the run started, so absolute times are noisy; compare the ratio.",
        "",
        "| layout | step time (ms) | range (ms) | vs EP=1 | all-to-all sent per rank and step (MB) |",
        "|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        times = [t for t, _ in measured[layout]]
        megabytes = measured[layout][0][1]
        lines.append(
            f"| {names[layout]} | {statistics.median(times) * 1e3:.1f} | {min(times) * 1e3:.1f}–"
            f"{max(times) * 1e3:.1f} | {statistics.median(times) / baseline:.2f}x | {megabytes:.2f} |"
        )
    uniform = uniform_megabytes(args.model)
    ep2_megabytes = measured["ep2"][0][1]
    history = measured["balance"]
    tail = max(1, len(history["0.01"]) // 5)
    lines += [
        "",
        f"All-to-all volume of EP=2: {ep2_megabytes:.2f} MB sent per rank and step against {uniform:.2f} MB if "
        f"routing were uniform ({ep2_megabytes / uniform:.2f}x): the rows a rank sends the other depend on how "
        "many of its tokens the router gives the other rank's experts. EP=1 sends none, but all-reduces the "
        "expert gradients (EP=2 reduces only the dense ones).",
        "",
        f"Load balance over {args.balance_steps} steps (`tiny_moe`, EP=2; worst layer's most-loaded expert / "
        "mean; 1.0 is perfect balance), mean over the last "
        f"{tail} steps: with aux loss (coeff 1e-2) {statistics.mean(history['0.01'][-tail:]):.2f}, without "
        f"{statistics.mean(history['0.0'][-tail:]):.2f}; first step {history['0.01'][0]:.2f} / "
        f"{history['0.0'][0]:.2f}. Plot: `benchmarks/{PLOT.name}`.",
        "",
        "An imbalance of 2.0 means every token of a layer chose the same 2 of 4 experts. The Switch loss is "
        "coeff x experts x sum_e P_e f_e (P: mean router probability, f: token share); while the router's softmax "
        "stays near uniform (P_e close to 1/experts, as with this small init and 100 steps) it stays close to "
        "coeff whatever f is, so its gradient barely moves the top-k choice. The loss and its gradient are "
        "checked against a plain-loop reference in tests/models/test_moe.py.",
        "",
        "On CPU the experts of a rank run one after another (`GroupedExperts`); on GPUs a grouped GEMM "
        "(`torch._grouped_mm`, Transformer Engine's GroupedLinear) would run them in one kernel, and the "
        "all-to-all would overlap with computation of the shared expert.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    check_dependencies(["torch", "matplotlib"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small_moe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--balance-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print the section without writing RESULTS.md")
    args = parser.parse_args()
    load_average = os.getloadavg()[0]
    measured = run(args)
    section = report(measured, args, load_average)
    print(section)
    if not args.no_write:
        write_section(section)
        plot(measured["balance"])


if __name__ == "__main__":
    main()

"""Hugging Face Llama import/export speed and peak memory against `transformers` itself.

    python benchmarks/convert_bench.py [--hidden-size 1536] [--layers 8] [--reps 3] [--no-write]

A random Llama (fp32, GQA, >= 1 GiB with the defaults) is saved once with `save_pretrained`. Then, interleaved
in every repetition and each in a fresh process (so peak memory is that operation's alone):

- import: `nemo_ckpt.api.import_ckpt("hf://...")` vs `LlamaForCausalLM.from_pretrained(...)`;
- export: `nemo_ckpt.api.export_ckpt(..., target="hf")` vs `save_pretrained(...)` of the model loaded beforehand
  (loading is not timed; its memory is what a `transformers` user holds while saving).

Time: wall seconds of the operation inside its process (Python and torch start-up excluded). Memory: the
process's peak resident set (`ru_maxrss`) minus its resident set just before the operation; memory-mapped file
pages the operation touches count too. Medians of `--reps`; ratios ours / transformers. Writes the
`## Model conversion` section of benchmarks/RESULTS.md.
"""

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import check_dependencies, write_section

REPO = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_operation(operation: str, source: str, output: str) -> None:
    """In a fresh process: run `operation`, print {"seconds", "peak_mib"} as JSON."""
    import torch
    import transformers

    from nemo_ckpt.api import export_ckpt, import_ckpt

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = None
    if operation == "hf_save":
        model = transformers.LlamaForCausalLM.from_pretrained(source)
    before = rss_mib()
    start = time.perf_counter()
    if operation == "ours_import":
        import_ckpt(f"hf://{source}", output)
    elif operation == "hf_load":
        model = transformers.LlamaForCausalLM.from_pretrained(source)
    elif operation == "ours_export":
        export_ckpt(source, output, target="hf")
    elif operation == "hf_save":
        model.save_pretrained(output)
    else:
        raise ValueError(f"unknown operation {operation!r}")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_mib": max(0.0, peak - before)}))


def measure(operation: str, source: Path, output: Path) -> dict[str, float]:
    shutil.rmtree(output, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks")])}
    command = [sys.executable, __file__, "--operation", operation, str(source), str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        sys.exit(f"{operation} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def make_llama(directory: Path, hidden_size: int, layers: int) -> float:
    """Save a random fp32 Llama; return its size in GiB."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 256 * 256 + 256,
        num_hidden_layers=layers,
        num_attention_heads=hidden_size // 128,
        num_key_value_heads=max(1, hidden_size // 128 // 3),
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    model.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden-size", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    parser.add_argument("--operation", help=argparse.SUPPRESS)
    parser.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.operation:
        run_operation(args.operation, *args.paths)
        return
    check_dependencies(["torch", "transformers", "safetensors"])
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        size = make_llama(root / "hf", args.hidden_size, args.layers)
        measure("ours_import", root / "hf", root / "ours")  # the checkpoint the exports start from
        runs: dict[str, list[dict[str, float]]] = {
            op: [] for op in ("ours_import", "hf_load", "ours_export", "hf_save")
        }
        for _ in range(args.reps):
            runs["ours_import"].append(measure("ours_import", root / "hf", root / "imported"))
            runs["hf_load"].append(measure("hf_load", root / "hf", root / "unused"))
            runs["ours_export"].append(measure("ours_export", root / "ours", root / "exported"))
            runs["hf_save"].append(measure("hf_save", root / "hf", root / "saved"))
    median = {op: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_mib")} for op, rs in runs.items()}
    rows = [
        ("import", "ours_import", "hf_load", "`import_ckpt` vs `from_pretrained`"),
        ("export", "ours_export", "hf_save", "`export_ckpt` vs `save_pretrained`"),
    ]
    lines = [
        "## Model conversion",
        "",
        f"Hugging Face Llama (fp32, {size:.2f} GiB, hidden {args.hidden_size}, {args.layers} layers, GQA) on "
        f"{platform.machine()} with {os.cpu_count()} cores, CPU-only torch; medians of {args.reps} interleaved "
        "repetitions, each operation in a fresh process (`benchmarks/convert_bench.py`). Peak memory: the "
        "process's peak resident set minus its resident set before the operation (memory-mapped pages count).",
        "",
        "| | ours (s) | transformers (s) | time ratio | ours peak (MiB) | transformers peak (MiB) | memory ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ours, theirs, what in rows:
        a, b = median[ours], median[theirs]
        lines.append(
            f"| {name}: {what} | {a['seconds']:.2f} | {b['seconds']:.2f} | {a['seconds'] / b['seconds']:.2f}x | "
            f"{a['peak_mib']:.0f} | {b['peak_mib']:.0f} | {a['peak_mib'] / max(b['peak_mib'], 1):.2f}x |"
        )
    load = os.getloadavg()[0]
    lines += ["", f"Load average at the end of the run: {load:.1f} (other processes on the machine inflate times)."]
    section = "\n".join(lines) + "\n"
    print(section)
    if not args.no_write:
        write_section(section)


if __name__ == "__main__":
    main()

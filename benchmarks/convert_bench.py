"""Hugging Face import/export of each supported family: accuracy, speed and peak memory against `transformers`.

    python benchmarks/convert_bench.py [--families llama,mistral,qwen2,qwen3,mixtral] [--hidden-size 1536]
        [--layers 8] [--reps 3] [--no-write]

Per family, a random model (fp32, GQA, >= 1 GiB with the defaults; Llama with Llama 3.1's rope scaling, Qwen3 with
its own head width, Mixtral with 8 experts, top-2, on fewer layers) is saved once with `save_pretrained`. Accuracy,
in a fresh process: the largest |difference| of our imported model's logits from transformers' on 32 tokens (fp32),
and whether our export's tensors equal the source's bit for bit. Then, interleaved in every repetition and each in a
fresh process (so peak memory is that operation's alone):

- import: `nemo_ckpt.api.import_ckpt("hf://...")` vs `AutoModelForCausalLM.from_pretrained(...)`;
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
    if operation == "check":
        print(json.dumps(accuracy(Path(source), Path(output))))
        return
    if operation == "hf_save":
        model = transformers.AutoModelForCausalLM.from_pretrained(source)
    before = rss_mib()
    start = time.perf_counter()
    if operation == "ours_import":
        import_ckpt(f"hf://{source}", output)
    elif operation == "hf_load":
        model = transformers.AutoModelForCausalLM.from_pretrained(source)
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


def accuracy(source: Path, checkpoint: Path) -> dict[str, float | bool]:
    """Our import (to `checkpoint`) of `source`: its logits against transformers' (largest |difference|), and its
    export's bit-exactness."""
    import torch
    import transformers

    from nemo_ckpt.api import export_ckpt, import_ckpt
    from nemo_ckpt.checkpoint.context import load_model
    from nemo_ckpt.models.gpt.convert.safetensors_io import open_model_weights

    import_ckpt(f"hf://{source}", str(checkpoint))
    tokens = torch.randint(1000, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(tokens).logits
        ours = load_model(checkpoint).float()(tokens)[..., : theirs.shape[-1]]
    exported = export_ckpt(str(checkpoint), str(checkpoint.parent / "exported-check"), target="hf")
    original, back = open_model_weights(source), open_model_weights(exported)
    exact = original.keys() == back.keys() and all(torch.equal(original[key], back[key]) for key in back)
    return {"max_diff": float((ours - theirs).abs().max()), "bit_exact": exact}


def family_config(family: str, hidden_size: int, layers: int):
    """A transformers config of `family` with about the weights of a `hidden_size` x `layers` Llama."""
    import transformers

    heads = hidden_size // 128
    common = dict(
        vocab_size=32000,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 8 // 3 // 256 * 256 + 256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 3),
        max_position_embeddings=2048,
    )
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=128 + 64)
    if family == "mixtral":
        moe = {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}
        return transformers.MixtralConfig(**{**common, "num_hidden_layers": max(1, layers // 2)}, **moe)
    raise ValueError(f"unknown family {family!r}; use llama, mistral, qwen2, qwen3 or mixtral")


def make_model(directory: Path, family: str, hidden_size: int, layers: int) -> float:
    """Save a random fp32 model of `family`; return its size in GiB."""
    import torch
    import transformers

    config = family_config(family, hidden_size, layers)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.02)
    model.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="llama,mistral,qwen2,qwen3,mixtral")
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
    rows = [measure_family(family, args) for family in args.families.split(",")]
    lines = [
        "## Model conversion",
        "",
        f"Each Hugging Face family (fp32, hidden {args.hidden_size}, {args.layers} layers, GQA; Mixtral half the "
        "layers, 8 experts, top-2) on "
        f"{platform.machine()} with {os.cpu_count()} cores, CPU-only torch; medians of {args.reps} interleaved "
        "repetitions, each operation in a fresh process (`benchmarks/convert_bench.py`). Logits: largest |difference| "
        "of our import from transformers' on 32 tokens, fp32. Peak memory: the process's peak resident set minus its "
        "resident set before the operation (memory-mapped pages count). Import: `import_ckpt` vs `from_pretrained`; "
        "export: `export_ckpt` vs `save_pretrained`.",
        "",
        "| family | GiB | logits max \\|diff\\| | export bit-exact | import ours / transformers (s) | import peak "
        "ours / transformers (MiB) | export ours / transformers (s) | export peak ours / transformers (MiB) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Load average at the end of the run: {os.getloadavg()[0]:.1f} (other processes on the machine inflate times).",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    if not args.no_write:
        write_section(section)


def measure_family(family: str, args: argparse.Namespace) -> str:
    """One family's table row."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        size = make_model(root / "hf", family, args.hidden_size, args.layers)
        measure("ours_import", root / "hf", root / "ours")  # the checkpoint the exports start from
        check = measure("check", root / "hf", root / "check")
        runs: dict[str, list[dict[str, float]]] = {
            op: [] for op in ("ours_import", "hf_load", "ours_export", "hf_save")
        }
        for _ in range(args.reps):
            runs["ours_import"].append(measure("ours_import", root / "hf", root / "imported"))
            runs["hf_load"].append(measure("hf_load", root / "hf", root / "unused"))
            runs["ours_export"].append(measure("ours_export", root / "ours", root / "exported"))
            runs["hf_save"].append(measure("hf_save", root / "hf", root / "saved"))
    median = {op: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak_mib")} for op, rs in runs.items()}

    def pair(ours: str, theirs: str, key: str, digits: int) -> str:
        a, b = median[ours][key], median[theirs][key]
        return f"{a:.{digits}f} / {b:.{digits}f} ({a / max(b, 1e-9):.2f}x)"

    return (
        f"| {family} | {size:.2f} | {check['max_diff']:.1e} | {'yes' if check['bit_exact'] else 'NO'} | "
        f"{pair('ours_import', 'hf_load', 'seconds', 2)} | {pair('ours_import', 'hf_load', 'peak_mib', 0)} | "
        f"{pair('ours_export', 'hf_save', 'seconds', 2)} | {pair('ours_export', 'hf_save', 'peak_mib', 0)} |"
    )


if __name__ == "__main__":
    main()

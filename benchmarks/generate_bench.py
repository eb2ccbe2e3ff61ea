"""Generation speed: `nemo_ckpt.inference.generate.generate_tokens` against transformers' `generate` on the same
weights and threads.

    python benchmarks/generate_bench.py [--model small] [--batches 1,8] [--new-tokens 128] [--prompt-tokens 32]
                                        [--reps 5] [--threads N] [--device cpu|cuda] [--compile] [--no-write]

The weights: a random Llama (`LlamaForCausalLM`) of the preset's shape (`gpt_config(--model)`, positions for the
prompt and the new tokens), imported with `import_hf`, so both sides hold the same tensors. Greedy decoding of
`--new-tokens` tokens after a random prompt of `--prompt-tokens` tokens per row, no stop token; the two sides'
tokens are checked equal. Tokens per second: batch x new tokens / the time of the whole generation; time to first
token: the time of a generation of 1 token (prefill and first sample). Each repetition measures every batch size
on both sides, rotating which goes first; medians over `--reps`, after a warm-up. `--compile`: our decode steps
through `torch.compile` (`generate_tokens(compiled=True)`, the GPU path). Writes the `## Generation` section of
benchmarks/RESULTS.md (with `--compile` or `--device cuda`, its own section).
"""

import argparse
import os
import platform
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from results import check_dependencies, settled, write_section

check_dependencies(["torch", "transformers"])

import torch  # noqa: E402
import transformers  # noqa: E402

from nemo_ckpt.checkpoint.context import load_model  # noqa: E402
from nemo_ckpt.inference.generate import generate_tokens  # noqa: E402
from nemo_ckpt.inference.sampling import SamplingParams  # noqa: E402
from nemo_ckpt.models.gpt.convert import import_hf  # noqa: E402
from nemo_ckpt.models.gpt.model import GPTConfig, gpt_config  # noqa: E402

SECTION = "## Generation"


def llama_config(config: GPTConfig) -> transformers.LlamaConfig:
    """The Hugging Face Llama of `config`'s shape."""
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups,
        max_position_embeddings=config.seq_length,
        rms_norm_eps=config.layernorm_epsilon,
        rope_theta=config.rotary_base,
        tie_word_embeddings=config.share_embeddings_and_output_weights,
    )


def make_models(config: GPTConfig, directory: Path, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Ours and transformers' model with the same random weights, in eval mode on `device`."""
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(llama_config(config)).eval()
    theirs.save_pretrained(directory / "hf")
    ours = load_model(import_hf(directory / "hf", directory / "ours")).eval()
    shape = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "seq_length")
    assert all(getattr(ours.config, name) == getattr(config, name) for name in shape), ours.config
    return ours.to(device), theirs.to(device)


def timed(generate, prompts: torch.Tensor, new_tokens: int) -> tuple[float, list[list[int]]]:
    start = settled()
    tokens = generate(prompts, new_tokens)
    return settled() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--compile", action="store_true", help="our decode steps through torch.compile")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = gpt_config(args.model)
    config = replace(base, seq_length=max(base.seq_length, args.prompt_tokens + args.new_tokens))

    def ours_generate(prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
        return generate_tokens(ours, prompts.tolist(), SamplingParams(max_new_tokens=new_tokens), compiled=args.compile)

    @torch.inference_mode()
    def hf_generate(prompts: torch.Tensor, new_tokens: int) -> list[list[int]]:
        out = theirs.generate(
            prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        return out[:, prompts.shape[1] :].tolist()

    sides = {"ours": ours_generate, "transformers": hf_generate}
    batches = [int(batch) for batch in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = make_models(config, Path(tmp), args.device)
    generator = torch.Generator().manual_seed(0)
    prompts = {
        batch: torch.randint(config.vocab_size, (batch, args.prompt_tokens), generator=generator).to(args.device)
        for batch in batches
    }
    for batch in batches:  # warm-up, and the check that both sides generate the same tokens
        generated = {side: generate(prompts[batch], args.new_tokens) for side, generate in sides.items()}
        assert generated["ours"] == generated["transformers"], f"batch {batch}: the tokens differ"
    times: dict[tuple[str, int, int], list[float]] = {}
    for rep in range(args.reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for batch in batches:
            for side in order:
                for new_tokens in (1, args.new_tokens):
                    seconds, _ = timed(sides[side], prompts[batch], new_tokens)
                    times.setdefault((side, batch, new_tokens), []).append(seconds)
    median = {key: statistics.median(values) for key, values in times.items()}
    rows = []
    for batch in batches:
        speed = {side: batch * args.new_tokens / median[side, batch, args.new_tokens] for side in sides}
        first = {side: median[side, batch, 1] * 1000 for side in sides}
        rows.append(
            f"| {batch} | {speed['ours']:.0f} / {speed['transformers']:.0f} "
            f"({speed['ours'] / speed['transformers']:.2f}x) | {first['ours']:.1f} / {first['transformers']:.1f} "
            f"({first['transformers'] / first['ours']:.2f}x) |"
        )
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU"
    variant = " ".join(
        option for option, used in (("--compile", args.compile), ("--device cuda", args.device == "cuda")) if used
    )
    lines = [
        f"{SECTION} ({variant})" if variant else SECTION,
        "",
        f"`python benchmarks/generate_bench.py{' ' + variant if variant else ''}` on {device}, "
        f"{args.threads} torch threads for both sides, torch {torch.__version__}, transformers "
        f"{transformers.__version__}: the `{args.model}` GPT ({config.num_layers} layers, hidden "
        f"{config.hidden_size}, vocab {config.vocab_size}, fp32) and the same weights as a `LlamaForCausalLM`; "
        f"greedy, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens per row (equal tokens on both "
        f"sides, checked). Medians of {args.reps} interleaved repetitions. Tokens/s: batch x new tokens / time of "
        "the generation; time to first token: a 1-token generation (prefill and first token). Ratios: how many "
        "times faster ours is.",
        "",
        "| batch | tokens/s ours / transformers | time to first token ours / transformers (ms) |",
        "|---|---|---|",
        *rows,
        "",
        f"Load average at the end of the run: {os.getloadavg()[0]:.1f}.",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    if not args.no_write:
        write_section(section)


if __name__ == "__main__":
    main()

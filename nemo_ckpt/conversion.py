"""`import_ckpt` / `export_ckpt`, NeMo's names for checkpoint conversion (`llm.import_ckpt`, `llm.export_ckpt`).

Sources and targets: `hf` (a local Hugging Face directory of LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM or MixtralForCausalLM), `megatron` (Megatron-Core GPT naming: the weights
alone) and `nemo2` (a NeMo 2.0 checkpoint directory: the weights in Megatron-Core naming and the model config and
tokenizer in its `context/`). A source is `hf:///abs/path`, `megatron:///abs/path` or `nemo2:///abs/path`.
Both print what they wrote: the output, the model's shape and parameter count, its files and bytes.
"""

from pathlib import Path

import torch

from nemo_ckpt.models.gpt.convert.checkpoint_io import checkpoint_gpt_config
from nemo_ckpt.models.gpt.convert.hf import export_hf, import_hf
from nemo_ckpt.models.gpt.convert.megatron import export_megatron, import_megatron
from nemo_ckpt.models.gpt.convert.nemo2 import export_nemo2, import_nemo2
from nemo_ckpt.models.gpt.model import GPTConfig
from nemo_ckpt.peft.merge import adapter_config, merged_tensor_reader

FORMATS = ("hf", "megatron", "nemo2")


def _split_source(source: str) -> tuple[str, Path]:
    scheme, separator, path = source.partition("://")
    if not separator or scheme not in FORMATS:
        raise ValueError(
            f"import_ckpt(source={source!r}): use hf:///path/to/dir, megatron:///path/to/checkpoint or "
            "nemo2:///path/to/nemo/checkpoint"
        )
    return scheme, Path(path)


def summary(output: Path, checkpoint: Path) -> str:
    """What a conversion wrote to `output`: the shape of `checkpoint`'s model, the files and their bytes."""
    config = checkpoint_gpt_config(checkpoint)
    sizes = [path.stat().st_size for path in output.rglob("*") if path.is_file()]
    heads = f"{config.num_attention_heads} heads ({config.num_query_groups} query groups)"
    return (
        f"{output}\n"
        f"  model: {config.num_layers} layers, hidden {config.hidden_size}, {heads}, vocab {config.vocab_size}, "
        f"{config.num_parameters():,} parameters\n"
        f"  files: {len(sizes)}, {sum(sizes):,} bytes ({sum(sizes) / 2**20:.1f} MiB)"
    )


def import_ckpt(
    source: str,
    output_path: str,
    config: GPTConfig | None = None,
    make_vocab_size_divisible_by: int = 1,
    overwrite: bool = False,
) -> Path:
    """Convert `source` (`hf:///dir`, `megatron:///checkpoint` or `nemo2:///checkpoint`) into our checkpoint at
    `output_path`.

    Hugging Face families: LlamaForCausalLM (Llama 2, 3, 3.1+ with llama3 rope scaling), MistralForCausalLM (no
    sliding window shorter than the sequence), Qwen2ForCausalLM, Qwen3ForCausalLM and MixtralForCausalLM; any
    other architecture is refused, naming it.

    NeMo 2.0 checkpoints: of NeMo's Llama, Mistral, Qwen2, Qwen3 and Mixtral models, their config read from
    `context/io.json` as data (NeMo's config classes by name, with their defaults; nothing is imported or run).

    `config`: the GPT's shape, needed for `megatron` sources (their tensors do not tell the number of heads);
    `hf` sources take it from `config.json`, `nemo2` sources from their context.
    `make_vocab_size_divisible_by`: the padding of a Hugging Face model's vocabulary (others keep their rows).
    """
    scheme, path = _split_source(source)
    if scheme != "hf" and make_vocab_size_divisible_by != 1:
        raise ValueError(
            f"import_ckpt(source='{scheme}://...') keeps the checkpoint's embedding rows; drop "
            "make_vocab_size_divisible_by= (it pads Hugging Face vocabularies)"
        )
    if scheme in ("hf", "nemo2") and config is not None:
        where = "config.json" if scheme == "hf" else "context/io.json"
        raise ValueError(f"import_ckpt(source='{scheme}://...') takes the model config from {where}; drop config=")
    if scheme == "hf":
        output = import_hf(path, output_path, make_vocab_size_divisible_by, overwrite)
    elif scheme == "nemo2":
        output = import_nemo2(path, output_path, overwrite)
    elif config is None:
        raise ValueError("import_ckpt(source='megatron://...') needs config=GPTConfig(...) (e.g. gpt_config('tiny'))")
    else:
        output = import_megatron(path, output_path, config, overwrite=overwrite)
    print(f"import_ckpt: wrote {summary(output, output)}")
    return output


def export_ckpt(
    path: str,
    output_path: str,
    target: str = "hf",
    dtype: str | None = None,
    artifacts_from: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write our checkpoint `path` as `target` (`hf`, `megatron` or `nemo2`: a NeMo 2.0 checkpoint directory that
    NeMo's `llm` API loads) to `output_path`.

    Hugging Face families: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    MixtralForCausalLM (an import keeps its own; a model trained here is written as Mixtral with experts, Qwen3
    with q/k norms, Qwen2 with q/k/v biases, else Llama).

    An adapter (LoRA) checkpoint is merged into its base on the way. The Hugging Face export carries the tokenizer
    `path` stores (every checkpoint saved in training stores its data's; an adapter checkpoint's base serves if it
    stores none), its bos/eos/pad ids in `config.json` and `generation_config.json`. `dtype` (`bfloat16`,
    `float32`, ...): of the Hugging Face weights; default: the imported model's, else the checkpoint's.
    `artifacts_from`: an imported checkpoint whose Hugging Face `config.json` (and tokenizer, where `path` stores
    none) go with the weights; a full fine-tune of an imported model may name the import here to keep its config.
    A model the converter cannot handle (an MoE model Mixtral cannot express) raises `UnsupportedModelError`,
    naming why, before anything is written.
    """
    if target not in FORMATS:
        raise ValueError(f"export_ckpt(target={target!r}): use one of {FORMATS}")
    hf_only = [name for name, value in (("dtype", dtype), ("artifacts_from", artifacts_from)) if value is not None]
    if target != "hf" and hf_only:
        raise ValueError(f"export_ckpt(target={target!r}) writes the checkpoint's own dtype and config: drop {hf_only}")
    torch_dtype = None
    if dtype is not None:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"export_ckpt(dtype={dtype!r}): use a torch dtype name such as 'bfloat16' or 'float32'")
    base, read = merged_tensor_reader(path) if adapter_config(path) is not None else (None, None)
    if target == "megatron":
        output = export_megatron(path, output_path, overwrite=overwrite, read_tensor=read, base=base)
    elif target == "nemo2":
        output = export_nemo2(path, output_path, overwrite=overwrite, read_tensor=read, base=base)
    else:
        output = export_hf(
            path,
            output_path,
            torch_dtype,
            artifacts_from=artifacts_from,
            base=base,
            overwrite=overwrite,
            read_tensor=read,
        )
    print(f"export_ckpt: wrote {summary(output, Path(path))}")
    return output

"""`import_ckpt` / `export_ckpt`, NeMo's names for checkpoint conversion (`llm.import_ckpt`, `llm.export_ckpt`).

Sources and targets: `hf` (a local Hugging Face Llama directory) and `megatron` (Megatron-Core / NeMo 2.0 GPT
naming). A source is `hf:///abs/path` or `megatron:///abs/path`.
"""

from pathlib import Path

import torch

from nemo_ckpt.models.gpt.convert.hf import export_hf, import_hf
from nemo_ckpt.models.gpt.convert.megatron import export_megatron, import_megatron
from nemo_ckpt.models.gpt.model import GPTConfig
from nemo_ckpt.peft.merge import adapter_config, merged_tensor_reader

FORMATS = ("hf", "megatron")


def _split_source(source: str) -> tuple[str, Path]:
    scheme, separator, path = source.partition("://")
    if not separator or scheme not in FORMATS:
        raise ValueError(f"import_ckpt(source={source!r}): use hf:///path/to/dir or megatron:///path/to/checkpoint")
    return scheme, Path(path)


def import_ckpt(
    source: str,
    output_path: str,
    config: GPTConfig | None = None,
    make_vocab_size_divisible_by: int = 1,
    overwrite: bool = False,
) -> Path:
    """Convert `source` (`hf:///dir` or `megatron:///checkpoint`) into our checkpoint at `output_path`.

    `config`: the GPT's shape, needed for `megatron` sources (their tensors do not tell the number of heads);
    `hf` sources take it from `config.json`.
    """
    scheme, path = _split_source(source)
    if scheme == "hf":
        if config is not None:
            raise ValueError("import_ckpt(source='hf://...') takes the model config from config.json; drop config=")
        return import_hf(path, output_path, make_vocab_size_divisible_by, overwrite)
    if config is None:
        raise ValueError("import_ckpt(source='megatron://...') needs config=GPTConfig(...) (e.g. gpt_config('tiny'))")
    return import_megatron(path, output_path, config, overwrite=overwrite)


def export_ckpt(
    path: str,
    output_path: str,
    target: str = "hf",
    dtype: str | None = None,
    artifacts_from: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write our checkpoint `path` as `target` (`hf` or `megatron`) to `output_path`.

    An adapter (LoRA) checkpoint is merged into its base on the way (`hf` only). `dtype` (`bfloat16`, `float32`,
    ...): of the Hugging Face weights; default: the imported model's, else the checkpoint's. `artifacts_from`: the
    imported checkpoint whose Hugging Face config and tokenizer go with the weights (default: `path`'s own, or
    for an adapter checkpoint its base's); a full fine-tune of an imported model names the import here.
    """
    if target not in FORMATS:
        raise ValueError(f"export_ckpt(target={target!r}): use one of {FORMATS}")
    torch_dtype = None
    if dtype is not None:
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"export_ckpt(dtype={dtype!r}): use a torch dtype name such as 'bfloat16' or 'float32'")
    if target == "megatron":
        return export_megatron(path, output_path, overwrite=overwrite)
    if adapter_config(path) is not None:
        base, read = merged_tensor_reader(path)
        return export_hf(
            path, output_path, torch_dtype, artifacts_from=artifacts_from or base, overwrite=overwrite, read_tensor=read
        )
    return export_hf(path, output_path, torch_dtype, artifacts_from=artifacts_from, overwrite=overwrite)

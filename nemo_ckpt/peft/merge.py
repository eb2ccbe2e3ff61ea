"""Fold LoRA adapters into their base weights: an adapter checkpoint (written by a `GPTModel(peft=LoRA(...))` run)
plus the base checkpoint it points at become one full checkpoint, which `export_ckpt` can write to Hugging Face."""

from collections.abc import Callable
from pathlib import Path

import fiddle as fdl
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import save_context
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir, weights_dir
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models.gpt.convert.checkpoint_io import ConversionOutput, checkpoint_model, checkpoint_tensor_reader
from nemo_ckpt.models.gpt.convert.hf import (
    copy_artifacts,
    gpt_shapes,
    hf_artifact_sources,
)
from nemo_ckpt.models.gpt.lightning import GPTModel
from nemo_ckpt.peft.lora import LoRA, merge_weight


def adapter_config(checkpoint: str | Path) -> LoRA | None:
    """The `LoRA` a checkpoint's model was trained with (None for a full checkpoint)."""
    peft = checkpoint_model(checkpoint).peft
    return None if peft is None else fdl.build(peft)


def merged_tensor_reader(checkpoint: str | Path) -> tuple[Path, Callable[[str], torch.Tensor]]:
    """The base checkpoint of the adapter checkpoint `checkpoint`, and a function loading one merged tensor by key."""
    lora = adapter_config(checkpoint)
    if lora is None:
        raise ValueError(f"{checkpoint} is not an adapter checkpoint: its model config has no peft")
    if lora.base_checkpoint is None:
        raise ValueError(f"{checkpoint}: its LoRA config names no base_checkpoint to merge into")
    base = Path(lora.base_checkpoint)
    _, read_base = checkpoint_tensor_reader(base)
    adapters, read_adapter = checkpoint_tensor_reader(Path(checkpoint))
    scale = lora.alpha / lora.dim

    def read(key: str) -> torch.Tensor:
        weight = read_base(key)
        stem = key.removesuffix(".weight")
        if f"{stem}.lora_a" not in adapters:
            return weight
        return merge_weight(weight, read_adapter(f"{stem}.lora_a"), read_adapter(f"{stem}.lora_b"), scale)

    return base, read


def merge(checkpoint: str | Path, output: str | Path, overwrite: bool = False) -> Path:
    """Write the full checkpoint `base + adapters` of the adapter checkpoint `checkpoint` to `output`: weights,
    the model config without `peft`, and `context/hf`: the tokenizer the adapters were trained with (the base's if
    `checkpoint` stores none) and the base's Hugging Face model config, if any."""
    out = ConversionOutput(Path(output), overwrite)
    model = checkpoint_model(checkpoint)
    base, read = merged_tensor_reader(checkpoint)
    config = fdl.build(model.config)
    tensors = {key: read(key) for key in gpt_shapes(config)}
    tmp = out.start()
    try:
        target = weights_dir(tmp)
        target.mkdir(parents=True)
        state = {key: ShardedTensor.from_rank_offsets(key, tensor, replica_id=0) for key, tensor in tensors.items()}
        dist_checkpointing.save({"state_dict": state}, target)
        save_context(tmp, model=GPTModel(config, fdl.build(model.optim) if model.optim is not None else None))
        copy_artifacts(*hf_artifact_sources(Path(checkpoint), base=base), hf_artifacts_dir(tmp))
    except BaseException:
        out.abort()
        raise
    return out.commit()

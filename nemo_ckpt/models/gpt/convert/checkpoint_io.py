"""Reading and writing the checkpoints a conversion works on, shared by the Hugging Face and Megatron-Core converters
and the LoRA merge.

`checkpoint_tensor_reader` gives a checkpoint's tensors' metadata and loads one whole tensor at a time, whatever the
layout it was saved in; `checkpoint_model` and `checkpoint_gpt_config` read its stored model config as data
(`load_context`). `ConversionOutput` writes an output directory under a temporary name beside it and renames it into
place at the end, so an output is whole or absent. `check_convertible` refuses, before anything is written, a model
a converter cannot handle, with the features that converter lists.
"""

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fiddle as fdl
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import load_context
from nemo_ckpt.checkpoint.layout import TMP_PREFIX, context_dir, is_complete, weights_dir
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.dist_checkpointing.integrity import write_directory_checksums
from nemo_ckpt.models.gpt.lightning import GPTModel
from nemo_ckpt.models.gpt.model import GPTConfig


class UnsupportedModelError(ValueError):
    """A model the converter cannot write; the message lists each unsupported feature."""


def check_convertible(features: list[str], checkpoint: Path, conversion: str) -> None:
    """Raise `UnsupportedModelError` listing `features`, what of `checkpoint`'s model the `conversion` (e.g.
    "export to Hugging Face") cannot handle; nothing when the list is empty."""
    if features:
        raise UnsupportedModelError(f"{checkpoint} cannot {conversion}: {'; '.join(features)}")


def checkpoint_model(checkpoint: str | Path) -> fdl.Config:
    """The `GPTModel` config stored in `checkpoint`'s `context/model.json`, read as data (`load_context`)."""
    model = load_context(checkpoint, "model")
    if not issubclass(fdl.get_callable(model), GPTModel):
        raise ValueError(f"{checkpoint}: its context/model.json builds {fdl.get_callable(model)}, not a GPTModel")
    return model


def checkpoint_gpt_config(checkpoint: str | Path) -> GPTConfig:
    """The `GPTConfig` stored in `checkpoint`'s `context/model.json`."""
    return fdl.build(checkpoint_model(checkpoint).config)


def checkpoint_tensor_reader(checkpoint: Path) -> tuple[dict[str, ShardedTensor], Callable[[str], torch.Tensor]]:
    """The tensors' metadata of `checkpoint`'s weights and a function loading one whole tensor by key."""
    if not is_complete(checkpoint):
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint: {weights_dir(checkpoint)} is missing")
    weights = weights_dir(checkpoint)
    metadata = dist_checkpointing.load_tensors_metadata(weights)

    def read(key: str) -> torch.Tensor:
        if key not in metadata:
            raise KeyError(f"{checkpoint} holds no tensor {key!r}: it is not a full GPT checkpoint of its config")
        template = {key: metadata[key].without_data()}  # a fresh template: a load keeps its tensor in the one given
        return dist_checkpointing.load(template, weights, validate_access_integrity=False)[key]

    return metadata, read


@dataclass(frozen=True)
class ConversionOutput:
    """An output directory written under a temporary name beside it and renamed into place at the end."""

    path: Path
    overwrite: bool

    def __post_init__(self) -> None:
        if self.path.exists() and not self.overwrite:
            raise FileExistsError(f"{self.path} already exists; choose another output or pass overwrite=True")

    @property
    def tmp(self) -> Path:
        return self.path.parent / f"{TMP_PREFIX}{self.path.name}"

    def start(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def commit(self) -> Path:
        if context_dir(self.tmp).is_dir():  # a checkpoint of ours, whole now: its context's checksums go with it
            write_directory_checksums(context_dir(self.tmp))
        if self.path.exists():
            shutil.rmtree(self.path)
        self.tmp.rename(self.path)
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

"""Checkpoint converters of the GPT: Hugging Face families (`hf`) and Megatron-Core's GPT naming (`megatron`)."""

from nemo_ckpt.models.gpt.convert.checkpoint_io import UnsupportedModelError
from nemo_ckpt.models.gpt.convert.hf import export_hf, import_hf

__all__ = ["UnsupportedModelError", "export_hf", "import_hf"]

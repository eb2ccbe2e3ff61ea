"""Checkpoint converters of the GPT: Hugging Face Llama (`hf`) and Megatron-Core's GPT naming (`megatron`)."""

from nemo_ckpt.models.gpt.convert.hf import UnsupportedModelError, export_hf, import_hf

__all__ = ["UnsupportedModelError", "export_hf", "import_hf"]

"""Data: Megatron indexed datasets, tokenizers, GPT samples, blends and the data modules.

Names are imported on first use, so preprocessing workers do not load Lightning.
"""

import importlib
from typing import Any

_EXPORTS = {
    "BlendedDataset": "nemo_ckpt.data.blended_dataset",
    "ByteLevelTokenizer": "nemo_ckpt.data.tokenizer",
    "GPTDataset": "nemo_ckpt.data.gpt_dataset",
    "GPTDatasetConfig": "nemo_ckpt.data.gpt_dataset",
    "HFTokenizer": "nemo_ckpt.data.tokenizer",
    "IndexedDataset": "nemo_ckpt.data.indexed_dataset",
    "IndexedDatasetBuilder": "nemo_ckpt.data.indexed_dataset",
    "MockDataModule": "nemo_ckpt.data.mock",
    "PreTrainingDataModule": "nemo_ckpt.data.pretraining",
    "SentencePieceTokenizer": "nemo_ckpt.data.tokenizer",
    "get_nmt_tokenizer": "nemo_ckpt.data.tokenizer",
    "get_tokenizer": "nemo_ckpt.data.tokenizer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import an exported name on first use (PEP 562)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nemo_ckpt.data' has no attribute {name!r}")

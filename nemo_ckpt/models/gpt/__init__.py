"""The Llama-style GPT: the network (`model`), its tensor-parallel plan (`parallelize`) and its LightningModule
(`lightning`)."""

from nemo_ckpt.models.gpt.lightning import GPTModel
from nemo_ckpt.models.gpt.model import GPT, PRESETS, GPTConfig, TransformerLayer, gpt_config
from nemo_ckpt.models.gpt.parallelize import parallelize_gpt

__all__ = ["GPT", "PRESETS", "GPTConfig", "GPTModel", "TransformerLayer", "gpt_config", "parallelize_gpt"]

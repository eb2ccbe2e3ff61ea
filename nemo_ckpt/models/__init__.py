"""Models, each in its own package with its tensor-parallel plan and its LightningModule."""

from nemo_ckpt.models.gpt import GPT, GPTConfig, GPTModel, gpt_config

__all__ = ["GPT", "GPTConfig", "GPTModel", "gpt_config"]

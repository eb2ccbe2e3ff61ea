from nemo_ckpt.models.gpt import GPT, GPTConfig, gpt_config
from nemo_ckpt.models.lightning import GPTModel

__all__ = ["GPT", "GPTConfig", "GPTModel", "gpt_config"]

"""Recipe factories (NeMo-Run `run.Partial`s of `nemo_ckpt.api.pretrain`)."""

from recipes.finetune import finetune_recipe  # noqa: F401  (registers the factories of `finetune`)
from recipes.gpt import llama3_8b, pretrain_recipe, small, tiny

__all__ = ["llama3_8b", "pretrain_recipe", "small", "tiny"]

"""Recipe factories (NeMo-Run `run.Partial`s of `nemo_ckpt.api.pretrain`)."""

from recipes.gpt import llama3_8b, pretrain_recipe, small, tiny

__all__ = ["llama3_8b", "pretrain_recipe", "small", "tiny"]

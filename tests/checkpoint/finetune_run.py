"""The fine-tuning recipe on 2 ranks (`run_recipe`), optionally SIGKILLed at a step, and the tiny imported model and
SFT set it fine-tunes."""

import json
import os
import random
from pathlib import Path

import nemo_run as run
import torch

from recipes.finetune import finetune_recipe
from tests.helpers.distributed import run_recipe
from tests.helpers.tiny_run import KillAtStep

RUN_NAME = "finetune"
SEQ_LENGTH = 16


def imported_model_and_sft_set(root: Path) -> tuple[Path, Path]:
    """A tiny random Hugging Face Llama (GQA) imported as our checkpoint, and an SFT set of 16 echo tasks."""
    import transformers

    from nemo_ckpt.api import import_ckpt

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=260,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    base = import_ckpt(f"hf://{root / 'hf'}", str(root / "base"))
    rng = random.Random(0)
    (root / "sft").mkdir()
    with open(root / "sft" / "training.jsonl", "w") as file:
        for _ in range(16):
            word = "".join(rng.choice("abcd") for _ in range(4))
            file.write(json.dumps({"input": f"echo {word}", "output": word}) + "\n")
    return base, root / "sft"


def tiny_finetune_recipe(
    directory: str, base: str, data: str, peft_scheme: str, max_steps: int, kill_at_step: int | None = None
) -> run.Partial:
    """`finetune_recipe` on the tiny imported model, checkpointing every 2 steps and keeping all."""
    recipe = finetune_recipe(
        name=RUN_NAME,
        dir=directory,
        num_gpus_per_node=int(os.environ.get("WORLD_SIZE", 1)),
        restore_path=base,
        dataset_root=data,
        tokenizer="byte-level",
        peft_scheme=peft_scheme,
        max_steps=max_steps,
        micro_batch_size=2,
        seq_length=SEQ_LENGTH,
    )
    recipe.trainer.accelerator = "cpu"
    recipe.trainer.limit_val_batches = 0
    recipe.log.ckpt.every_n_train_steps = 2
    recipe.log.ckpt.save_top_k = -1
    recipe.optim.lr = 1e-2
    recipe.optim.lr_warmup_steps = 0
    if kill_at_step is not None:
        recipe.trainer.callbacks = [run.Config(KillAtStep, step=kill_at_step)]
    return recipe


def run_finetune(
    directory: Path, base: Path, data: Path, peft_scheme: str, max_steps: int, kill_at_step: int | None = None
) -> int:
    """Run `tiny_finetune_recipe` on 2 ranks; return 0 or the exit code of the rank that failed (`run_recipe`)."""
    args = (str(directory), str(base), str(data), peft_scheme, max_steps, kill_at_step)
    return run_recipe(tiny_finetune_recipe, 2, *args)

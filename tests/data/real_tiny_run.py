"""The tiny recipe on the generated corpus (`data="real"`) on 2 ranks, recording the tokens of every step.

Checkpoints every 3 steps (keeping all).
Each rank appends `{"step": global_step, "tokens": [...]}` per training batch to `DIR/batches-rank<R>.jsonl`.
"""

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import nemo_run as run

from nemo_ckpt.models import gpt_config
from recipes.gpt import data_module
from tests.helpers.tiny_run import tiny_recipe


class RecordBatches(pl.Callback):
    """Append each training batch's token ids, with the step it trains, to a per-rank JSONL file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        record = {"step": trainer.global_step, "tokens": batch["tokens"].tolist()}
        with open(Path(self.directory) / f"batches-rank{trainer.global_rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")


def batches(directory: Path, rank: int) -> dict[int, list]:
    """The tokens each step trained on (the last record of a step wins: a resumed run redoes killed steps)."""
    lines = (directory / f"batches-rank{rank}.jsonl").read_text().splitlines()
    return {record["step"]: record["tokens"] for record in map(json.loads, lines)}


def real_tiny_recipe(directory: str, max_steps: int, kill_at_step: int | None = None) -> run.Partial:
    recipe = tiny_recipe(directory, max_steps, kill_at_step=kill_at_step)
    recipe.log.ckpt.every_n_train_steps = 3
    recipe.data = data_module(
        "real",
        gpt_config("tiny").vocab_size,  # the corpus's tokenizer size; the model takes it (vocab_size=None)
        directory,
        None,
        None,
        seq_length=32,
        micro_batch_size=4,
        global_batch_size=4 * int(os.environ.get("WORLD_SIZE", 1)),
    )
    recipe.trainer.callbacks = [*recipe.trainer.callbacks, run.Config(RecordBatches, directory=directory)]
    return recipe

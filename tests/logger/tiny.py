"""The tiny GPT on a single-process CPU Trainer (no strategy of ours): fast enough for many small runs."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from nemo_ckpt.data import MockDataModule
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.optim import OptimizerConfig
from tests.helpers.trainer import build_trainer

MAX_STEPS = 3
GLOBAL_BATCH_SIZE = 4


def trainer(**kwargs: Any) -> pl.Trainer:
    """`build_trainer` for `MAX_STEPS` steps, logging every step; `kwargs` override."""
    return build_trainer(**({"max_steps": MAX_STEPS, "log_every_n_steps": 1} | kwargs))


def fit(trainer: pl.Trainer, ckpt_path: Path | None = None) -> None:
    """Train the tiny GPT on mock data (2 micro-batches of 2 per step), resuming from `ckpt_path`."""
    config = gpt_config("tiny")
    data = MockDataModule(config.seq_length, config.vocab_size, micro_batch_size=2, global_batch_size=GLOBAL_BATCH_SIZE)
    model = GPTModel(config, OptimizerConfig(lr=1e-3, lr_warmup_steps=1))
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)

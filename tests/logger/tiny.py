"""The tiny GPT on a single-process CPU Trainer (no strategy of ours): fast enough for many small runs."""

from pathlib import Path

import lightning.pytorch as pl

from nemo_ckpt.data import MockDataModule
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.optim import OptimizerConfig

MAX_STEPS = 3
GLOBAL_BATCH_SIZE = 4


def trainer(**kwargs) -> pl.Trainer:
    """A CPU Trainer without loggers, checkpointing, validation or progress bar; `kwargs` override."""
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_steps=MAX_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    return pl.Trainer(**(settings | kwargs))


def fit(trainer: pl.Trainer, ckpt_path: Path | None = None) -> None:
    """Train the tiny GPT on mock data (2 micro-batches of 2 per step), resuming from `ckpt_path`."""
    config = gpt_config("tiny")
    data = MockDataModule(config.seq_length, config.vocab_size, micro_batch_size=2, global_batch_size=GLOBAL_BATCH_SIZE)
    model = GPTModel(config, OptimizerConfig(lr=1e-3, lr_warmup_steps=1))
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)

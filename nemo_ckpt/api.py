"""`pretrain`: the entry point a recipe's `run.Partial` targets, like NeMo's `llm.pretrain`."""

from pathlib import Path

import lightning.pytorch as pl

from nemo_ckpt.checkpoint import context
from nemo_ckpt.checkpoint.resume import AutoResume
from nemo_ckpt.checkpoint.rng import RNGStateCallback
from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.optim import OptimizerConfig


def pretrain(
    model: pl.LightningModule,
    data: pl.LightningDataModule,
    trainer: pl.Trainer,
    log: NeMoLogger | None = None,
    resume: AutoResume | None = None,
    optim: OptimizerConfig | None = None,
    seed: int = 1234,
) -> Path:
    """Train `model` on `data`, resuming as `resume` says; return the checkpoint directory.

    Every rank seeds its random generators with `seed`, so ranks build identical models and runs repeat; a
    resumed run continues with the generator states saved in its checkpoint. With
    `AutoResume(restore_config=True)` the model is rebuilt from the checkpoint's stored config; `optim` still
    applies to it.
    """
    pl.seed_everything(seed, workers=True, verbose=False)
    log = log or NeMoLogger()
    resume = resume or AutoResume()
    log.setup(trainer)
    if not any(isinstance(callback, RNGStateCallback) for callback in trainer.callbacks):
        trainer.callbacks.append(RNGStateCallback())
    ckpt_path = resume.find_checkpoint(log.checkpoint_dir)
    model = resume.restore_model(ckpt_path, model)
    if optim is not None:
        context.set_init_arg(model, "optim", optim)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return log.checkpoint_dir

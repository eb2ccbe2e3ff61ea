"""`pretrain`: the entry point a recipe's `run.Partial` targets, like NeMo's `llm.pretrain`."""

from pathlib import Path

import lightning.pytorch as pl
import nemo_run as run

from nemo_ckpt.logger import NeMoLogger
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.resume import AutoResume


@run.cli.entrypoint(namespace="nemo_ckpt")
def pretrain(model: pl.LightningModule, data: pl.LightningDataModule, trainer: pl.Trainer,
             log: NeMoLogger | None = None, resume: AutoResume | None = None,
             optim: OptimizerConfig | None = None, seed: int = 1234) -> Path:
    """Train `model` on `data`, resuming as `resume` says; return the checkpoint directory.

    Every rank seeds its random generators with `seed`, so ranks build identical models and runs repeat.
    """
    pl.seed_everything(seed, workers=True, verbose=False)
    log = log or NeMoLogger()
    if optim is not None:
        model.optim = optim
    log.setup(trainer)
    ckpt_path = (resume or AutoResume()).find_checkpoint(log.checkpoint_dir)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return log.checkpoint_dir

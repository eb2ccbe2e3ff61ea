"""`NeMoLogger`: where a run writes its logs and checkpoints."""

from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint


@dataclass
class NeMoLogger:
    """Logs to `<log_dir>/<name>/` (CSV metrics) and checkpoints to `<log_dir>/<name>/checkpoints`."""

    name: str = "default"
    log_dir: str = "nemo_experiments"
    ckpt: ModelCheckpoint | None = None

    @property
    def experiment_dir(self) -> Path:
        return Path(self.log_dir) / self.name

    @property
    def checkpoint_dir(self) -> Path:
        if self.ckpt is not None and self.ckpt.dirpath is not None:
            return self.ckpt.dirpath
        return self.experiment_dir / "checkpoints"

    def setup(self, trainer: pl.Trainer) -> None:
        trainer.loggers = [CSVLogger(self.experiment_dir, name="", version="logs")]
        if self.ckpt is not None:
            self.ckpt.dirpath = self.checkpoint_dir
            if self.ckpt not in trainer.callbacks:
                trainer.callbacks.append(self.ckpt)

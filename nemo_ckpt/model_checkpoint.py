"""`ModelCheckpoint`: top-k by a monitored metric plus `-last`, committed atomically and recorded in a manifest."""

import os
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from nemo_ckpt.manifest import CheckpointRecord, Manifest

LAST_SUFFIX = "-last"
TMP_PREFIX = ".tmp-"


def field_name(metric: str) -> str:
    """A metric's name as a `filename` template field (`val/loss` -> `val_loss`)."""
    return metric.replace("/", "_")


def default_filename(monitor: str | None) -> str:
    """`<monitor>=<value>-epoch=<epoch>-step=<step>`, as NeMo and Lightning name checkpoints."""
    if monitor is None:
        return "epoch={epoch}-step={step}"
    name = field_name(monitor)
    return f"{name}={{{name}:.4f}}-epoch={{epoch}}-step={{step}}"


class ModelCheckpoint(Callback):
    """Save every `every_n_train_steps` optimizer steps and at the end of training.

    A checkpoint is written under `.tmp-<name>` and renamed once every rank has finished, then recorded in
    `checkpoints.json`. `<name>-last` is a link to the newest checkpoint, never a second copy. Of the others,
    the `save_top_k` best by `monitor` are kept (`-1`: all; no monitor: the newest).
    `filename` is a `str.format` template over `step`, `epoch` and the logged metrics.
    """

    def __init__(self, dirpath: str | Path | None = None, monitor: str | None = "reduced_train_loss",
                 mode: str = "min", save_top_k: int = 1, save_last: bool = True, every_n_train_steps: int = 0,
                 filename: str | None = None) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'")
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}): use -1 (keep all), 0 or more")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps
        self.filename = filename or default_filename(monitor)
        self._last_saved_step: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_train_steps > 0 and step % self.every_n_train_steps == 0 and step != self._last_saved_step:
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_saved_step:
            self.save(trainer)

    def format_name(self, trainer: pl.Trainer) -> tuple[str, dict[str, float]]:
        """The checkpoint's name from `filename`, and the scalar metrics it is recorded with."""
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1}
        if self.monitor and self.monitor not in metrics:
            raise KeyError(f"ModelCheckpoint(monitor={self.monitor!r}) is not among the logged metrics "
                           f"{sorted(metrics)}; log it or set `monitor` to one of them")
        fields = {field_name(key): value for key, value in metrics.items()}
        return self.filename.format(step=trainer.global_step, epoch=trainer.current_epoch, **fields), metrics

    def save(self, trainer: pl.Trainer) -> Path:
        """Write, commit and record a checkpoint of the current step on all ranks; return its path."""
        name, metrics = self.format_name(trainer)
        final, tmp = self.dirpath / name, self.dirpath / f"{TMP_PREFIX}{name}"
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        trainer.strategy.barrier("ModelCheckpoint.before_save")
        record = CheckpointRecord(name, trainer.global_step, trainer.current_epoch, metrics)

        def commit() -> None:
            if trainer.is_global_zero:
                self._commit(tmp, final, record)
            trainer.strategy.barrier("ModelCheckpoint.after_commit")

        trainer.save_checkpoint(tmp, weights_only=False, storage_options={"finalize_fn": commit})
        self._last_saved_step = trainer.global_step
        return final

    def _commit(self, tmp: Path, final: Path, record: CheckpointRecord) -> None:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        manifest = Manifest.read(self.dirpath)
        manifest.checkpoints = [r for r in manifest.checkpoints if r.name != record.name] + [record]
        previous_last = manifest.last
        if self.save_last:
            manifest.last = record.name
            self._link_last(record.name, previous_last)
        stale = self._stale_checkpoints(manifest)
        manifest.checkpoints = [r for r in manifest.checkpoints if r not in stale]
        manifest.write(self.dirpath)
        for record in stale:
            shutil.rmtree(self.dirpath / record.name, ignore_errors=True)

    def _link_last(self, name: str, previous: str | None) -> None:
        link = self.dirpath / f"{name}{LAST_SUFFIX}"
        tmp_link = self.dirpath / f"{TMP_PREFIX}{name}{LAST_SUFFIX}"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(name, target_is_directory=True)
        os.replace(tmp_link, link)
        if previous and previous != name:
            (self.dirpath / f"{previous}{LAST_SUFFIX}").unlink(missing_ok=True)

    def _stale_checkpoints(self, manifest: Manifest) -> list[CheckpointRecord]:
        """Checkpoints outside the top k that are not `-last`."""
        if self.save_top_k == -1:
            return []
        if self.monitor:
            ranked = sorted(manifest.checkpoints, key=lambda r: r.metrics[self.monitor], reverse=self.mode == "max")
        else:
            ranked = sorted(manifest.checkpoints, key=lambda r: r.step, reverse=True)
        return [r for r in ranked[self.save_top_k:] if r.name != manifest.last]

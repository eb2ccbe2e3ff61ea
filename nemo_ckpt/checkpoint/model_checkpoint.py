"""`ModelCheckpoint`: top-k by a monitored metric, `-last` and the best, committed atomically and recorded in a
manifest.

Life of a checkpoint (file-system changes by global rank 0 only; every step is atomic):

1. save: record it as `saving` in `checkpoints.json`, write it on all ranks under `.tmp-<name>`;
2. commit (the save's `finalize_fn`: right after a synchronous save, later for an asynchronous one, always
   after every rank's data is written): rename `.tmp-<name>` to `<name>`; record it `complete`, make it
   `last` and mark checkpoints no longer kept `deleting`; point the `<name>-last` link at it;
3. delete, after a broadcast that every rank passes only once the commit is visible: rename each `deleting`
   checkpoint to `.trash-<name>.<id>`, drop its record; a background thread removes the trash (training does not
   wait for the file system to free gigabytes; `teardown` waits for it).

A crash at any point leaves every visible `<name>` complete; the next run's `on_train_start` finishes or rolls
back whatever was in flight.
"""

import errno
import logging
import os
import shutil
import string
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from nemo_ckpt.checkpoint import context
from nemo_ckpt.checkpoint.layout import (
    LAST_SUFFIX,
    MANIFEST_NAME,
    TMP_PREFIX,
    TRASH_PREFIX,
    context_dir,
    is_complete,
    weights_dir,
)
from nemo_ckpt.checkpoint.lock import DirectoryLock
from nemo_ckpt.checkpoint.manifest import CheckpointRecord, Manifest
from nemo_ckpt.dist_checkpointing.core import fsync_path
from nemo_ckpt.dist_checkpointing.fault_points import pause_point
from nemo_ckpt.options import strict_options

log = logging.getLogger(__name__)


def field_name(metric: str) -> str:
    """A metric's name as a `filename` template field (`val/loss` -> `val_loss`)."""
    return metric.replace("/", "_")


def default_filename(monitor: str | None) -> str:
    """`<monitor>=<value>-epoch=<epoch>-step=<step>`, as NeMo and Lightning name checkpoints."""
    if monitor is None:
        return "epoch={epoch}-step={step}"
    name = field_name(monitor)
    return f"{name}={{{name}:.4f}}-epoch={{epoch}}-step={{step}}"


def template_fields(template: str) -> set[str]:
    return {field for _, field, _, _ in string.Formatter().parse(template) if field}


def lineage_of(checkpoint: Path) -> str | None:
    """The lineage of `checkpoint` from its directory's manifest (None for checkpoints of 0.2 and foreign ones)."""
    record = Manifest.read(checkpoint.parent).get(checkpoint.name)
    return None if record is None else record.lineage


def run_on_rank_zero(trainer: pl.Trainer, fn: Callable[[], Any], what: str) -> Any:
    """Run `fn` on global rank 0 only and return its result on every rank; if it fails, raise the same clear
    error on every rank. The broadcast doubles as a barrier: no rank returns before rank 0 is done."""
    result, error, cause = None, None, None
    if trainer.is_global_zero:
        try:
            result = fn()
        except Exception as exception:  # reported on every rank below
            error, cause = f"{what} failed: {type(exception).__name__}: {exception}", exception
    result, error = trainer.strategy.broadcast((result, error))
    if error is not None:
        raise RuntimeError(error) from cause
    return result


@strict_options()
class ModelCheckpoint(Callback):
    """Save every `every_n_train_steps` optimizer steps, every `train_time_interval`, at the end of each training
    epoch (`save_on_train_epoch_end`) and at the end of training, as NeMo's `ModelCheckpoint` does.

    Kept: the `save_top_k` best by `monitor` (`mode` "min" or "max"; `-1`: all; no monitor: the newest), the best
    one whatever `save_top_k` (`save_best_model`), and with `save_last` the newest one, linked as `<name>-last`
    (a symlink, never a second copy) together with the newest one that can resume training.
    The checkpoint written at the end of training holds the optimizer state too (`save_optim_on_train_end`, default
    True where NeMo's is False), so that a finished run extended to more steps resumes from its last checkpoint; with
    False it holds the weights only, which `AutoResume` resumes only with `ckpt_load_optimizer=False`.
    `filename` is a `str.format` template over `step` (required), `epoch` and the logged metrics (`/` read as
    `_`); `step` is the number of optimizer steps taken, the step a run resumed from it continues at.
    A run holds the directory's writer lock from set-up to teardown (`checkpoint/lock.py`): a second run on it is
    refused at set-up, naming the holder. Each checkpoint records its lineage (a fresh run starts one, a resumed run
    continues its checkpoint's); retention deletes only checkpoints of the run's own lineage.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        monitor: str | None = "reduced_train_loss",
        mode: str = "min",
        save_top_k: int = 3,
        save_last: bool = True,
        save_best_model: bool = False,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        save_on_train_epoch_end: bool = False,
        save_optim_on_train_end: bool = True,
        filename: str | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'")
        if save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}): use -1 (keep all), 0 or more")
        if save_top_k == 0 and not save_last and not save_best_model:
            raise ValueError(
                "ModelCheckpoint(save_top_k=0, save_last=False, save_best_model=False) keeps no "
                "checkpoint; set save_top_k, save_last or save_best_model, or drop the callback"
            )
        if save_best_model and monitor is None:
            raise ValueError("ModelCheckpoint(save_best_model=True) needs `monitor`, the metric that ranks checkpoints")
        if every_n_train_steps is not None and every_n_train_steps < 0:
            raise ValueError(
                f"ModelCheckpoint(every_n_train_steps={every_n_train_steps}): use a positive number, "
                "or 0/None to disable"
            )
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise TypeError(f"ModelCheckpoint(train_time_interval={train_time_interval!r}): use a datetime.timedelta")
        filename = filename or default_filename(monitor)
        if "step" not in template_fields(filename):
            raise ValueError(
                f"ModelCheckpoint(filename={filename!r}) must contain the field {{step}}, so that "
                "checkpoints of different steps have different names"
            )
        if "/" in filename or filename.startswith(".") or filename.endswith(LAST_SUFFIX):
            raise ValueError(
                f"ModelCheckpoint(filename={filename!r}): a name has no '/', does not start with '.' "
                f"and does not end with {LAST_SUFFIX!r}"
            )
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.save_best_model = save_best_model
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.save_optim_on_train_end = save_optim_on_train_end
        self.filename = filename
        self._last_saved_step: int | None = None
        self._last_saved_path: Path | None = None
        self._last_save_time = time.monotonic()
        self._validation_ran = False
        self._trash_remover: ThreadPoolExecutor | None = None
        self._lock: DirectoryLock | None = None
        self.lineage: str | None = None

    # Lightning hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"
        run_on_rank_zero(
            trainer,
            self._check_writable,
            f"ModelCheckpoint(dirpath={str(self.dirpath)!r}) is not "
            "writable; choose a writable dirpath (or NeMoLogger.log_dir): checking it",
        )
        self._lock = DirectoryLock(self.dirpath)
        run_on_rank_zero(trainer, self._lock.acquire, f"ModelCheckpoint: taking the writer lock of {self.dirpath}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        resumed = trainer.ckpt_path is not None
        run_on_rank_zero(trainer, lambda: self.recover(resumed), f"ModelCheckpoint: recovering {self.dirpath}")
        self._last_saved_step = trainer.global_step if resumed else None
        self._last_saved_path = Path(trainer.ckpt_path) if resumed else None
        self.lineage = lineage_of(Path(trainer.ckpt_path)) if resumed else uuid.uuid4().hex
        self._last_save_time = time.monotonic()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == 0 or step == self._last_saved_step:
            return
        due = self.every_n_train_steps > 0 and step % self.every_n_train_steps == 0
        if not due and self.train_time_interval is not None:
            elapsed = time.monotonic() - self._last_save_time >= self.train_time_interval.total_seconds()
            due = trainer.strategy.broadcast(elapsed)
        if due:
            self.save(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validation_ran = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_on_train_epoch_end:
            self.save(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.save(trainer, weights_only=not self.save_optim_on_train_end)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._trash_remover is not None:  # deleted checkpoints are gone when fit returns
            self._trash_remover.shutdown(wait=True)
            self._trash_remover = None
        if self._lock is not None:
            self._lock.release()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._lock is not None:  # a failed fit calls no teardown hooks; the next run in this process may write
            self._lock.release()

    # Saving

    def format_name(self, trainer: pl.Trainer) -> tuple[str, dict[str, float]]:
        """The checkpoint's name from `filename`, and the scalar metrics it is recorded with."""
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1}
        if self.monitor and self.monitor not in metrics:
            message = (
                f"ModelCheckpoint(monitor={self.monitor!r}) is not among the logged metrics {sorted(metrics)}; "
                "log it or set `monitor` to one of them"
            )
            if self._validation_ran:
                raise KeyError(message)
            log.warning(
                "%s. Saving step %d without it (kept only as -last) until validation runs", message, trainer.global_step
            )
        fields = {field_name(key): value for key, value in metrics.items()}
        if self.monitor:
            fields.setdefault(field_name(self.monitor), float("nan"))
        unknown = template_fields(self.filename) - set(fields) - {"step", "epoch"}
        if unknown:
            raise KeyError(
                f"ModelCheckpoint(filename={self.filename!r}): {sorted(unknown)} are not step, epoch or "
                f"a logged metric {sorted(fields)}"
            )
        fields.update(step=trainer.global_step, epoch=trainer.current_epoch)
        return self.filename.format(**fields), metrics

    def save(self, trainer: pl.Trainer, weights_only: bool = False) -> Path:
        """Save the current step on all ranks (unless it already is); it becomes visible under the returned path
        once committed."""
        if trainer.global_step == self._last_saved_step and self._last_saved_path is not None:
            return self._last_saved_path
        name, metrics = run_on_rank_zero(trainer, lambda: self.format_name(trainer), "ModelCheckpoint: naming")
        record = CheckpointRecord(
            name, trainer.global_step, trainer.current_epoch, metrics, "saving", weights_only, self.lineage
        )
        tmp = self.dirpath / f"{TMP_PREFIX}{name}"
        replaced = run_on_rank_zero(
            trainer, lambda: self._begin(record, tmp, trainer), f"ModelCheckpoint: preparing {tmp}"
        )
        self._last_saved_step, self._last_saved_path = trainer.global_step, self.dirpath / name
        self._last_save_time = time.monotonic()
        try:
            trainer.save_checkpoint(
                tmp,
                weights_only=weights_only,
                storage_options={
                    "finalize_fn": lambda: self._commit(trainer, record),
                    "failure_fn": lambda: self._discard(trainer, record, tmp, replaced),
                },
            )
        except Exception as error:
            free_mib = shutil.disk_usage(self.dirpath).free / 2**20
            if trainer.is_global_zero:
                self._abort(record, tmp, replaced)
            raise RuntimeError(
                f"ModelCheckpoint could not save step {record.step} to {self.dirpath / name}: "
                f"{error}. The directory may be full ({free_mib:.1f} MiB free) or unwritable; "
                f"earlier checkpoints in {self.dirpath} are intact, resume from them once it is "
                "fixed"
            ) from error
        return self.dirpath / name

    def _begin(self, record: CheckpointRecord, tmp: Path, trainer: pl.Trainer) -> tuple[int, CheckpointRecord] | None:
        """Record the save and create its temporary directory; return the position and record of a checkpoint of
        the same name that it will replace (a run resumed from an older checkpoint saves the same steps again)."""
        manifest = Manifest.read(self.dirpath)
        replaced = manifest.get(record.name)
        if (self.dirpath / record.name).exists() and replaced is None:
            raise FileExistsError(
                f"{self.dirpath / record.name} exists but {self.dirpath / MANIFEST_NAME} does "
                "not list it; move it away or choose another dirpath"
            )
        self._check_space(manifest, record)
        position = manifest.checkpoints.index(replaced) if replaced else -1
        manifest.add(record)
        manifest.write(self.dirpath)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        context.save_context(tmp, model=trainer.lightning_module, data=trainer.datamodule)
        return (position, replaced) if replaced else None

    def _check_space(self, manifest: Manifest, record: CheckpointRecord) -> None:
        """Refuse to start a save that cannot fit: one needs as much space as the last one of its kind took."""
        alike = [r for r in manifest.complete() if r.weights_only == record.weights_only]
        if not alike:
            return
        needed = sum(p.lstat().st_size for p in (self.dirpath / alike[-1].name).rglob("*") if p.is_file())
        free = shutil.disk_usage(self.dirpath).free
        if free < needed:
            raise OSError(
                errno.ENOSPC,
                f"No space left for step {record.step} in {self.dirpath}: "
                f"{free / 2**20:.1f} MiB free, its last checkpoint took {needed / 2**20:.1f} "
                "MiB; free some space or choose another dirpath",
            )

    def _discard(
        self, trainer: pl.Trainer, record: CheckpointRecord, tmp: Path, replaced: tuple[int, CheckpointRecord] | None
    ) -> None:
        """An async save failed and the run goes on (`ckpt_async_save_failure='warn'`): undo it, so that the next
        interval saves again."""
        if trainer.is_global_zero:
            self._abort(record, tmp, replaced)
        if self._last_saved_step == record.step:
            self._last_saved_step, self._last_saved_path = None, None

    def _abort(self, record: CheckpointRecord, tmp: Path, replaced: tuple[int, CheckpointRecord] | None) -> None:
        """Undo a failed save's `_begin` as far as the file system lets us; `recover` does the rest later.
        A save that failed after its commit published it (another rank died then) is left as it is."""
        shutil.rmtree(tmp, ignore_errors=True)
        if record.state != "saving":
            return
        try:
            manifest = Manifest.read(self.dirpath)
            if manifest.get(record.name) == record:
                manifest.remove(record.name)
                if replaced is not None and is_complete(self.dirpath / record.name):
                    manifest.checkpoints.insert(*replaced)
                manifest.write(self.dirpath)
        except OSError as error:
            log.warning(
                "ModelCheckpoint: could not drop the record of the failed save %s (%s); the next run will",
                record.name,
                error,
            )

    def _commit(self, trainer: pl.Trainer, record: CheckpointRecord) -> None:
        """Publish a checkpoint that every rank has finished writing, then delete what is no longer kept."""
        stale = run_on_rank_zero(trainer, lambda: self._publish(record), f"ModelCheckpoint: committing {record.name}")
        if trainer.is_global_zero:
            self._delete(stale, background=True)

    def _publish(self, record: CheckpointRecord) -> list[str]:
        final, tmp = self.dirpath / record.name, self.dirpath / f"{TMP_PREFIX}{record.name}"
        replaced = self.dirpath / f"{TRASH_PREFIX}{record.name}"
        for directory in (weights_dir(tmp), context_dir(tmp), tmp):  # every file was fsynced by its writer
            if directory.is_dir():
                fsync_path(directory)
        pause_point("before-commit-rename")
        if final.exists():
            os.replace(final, replaced)
        os.replace(tmp, final)
        fsync_path(self.dirpath)
        pause_point("before-manifest-commit")
        manifest = Manifest.read(self.dirpath)
        record.state = "complete"
        manifest.update(record)
        if self.save_last:
            manifest.last = record.name
        stale = self.stale_checkpoints(manifest)
        for stale_record in stale:
            stale_record.state = "deleting"
        manifest.write(self.dirpath)
        self._link_last(manifest.last)
        shutil.rmtree(replaced, ignore_errors=True)
        log.info("ModelCheckpoint: saved %s (step %d)", final, record.step)
        return [stale_record.name for stale_record in stale]

    def _delete(self, names: list[str], background: bool = False) -> None:
        """Drop the checkpoints `names`: renamed away and unrecorded now, their files removed now or (`background`)
        by a thread of their own."""
        if not names:
            return
        try:
            trash = []
            for name in names:
                if (self.dirpath / name).exists():
                    trash.append(self.dirpath / f"{TRASH_PREFIX}{name}.{uuid.uuid4().hex[:8]}")
                    os.replace(self.dirpath / name, trash[-1])
            manifest = Manifest.read(self.dirpath)
            for name in names:
                manifest.remove(name)
            manifest.write(self.dirpath)
        except OSError as error:
            log.warning("ModelCheckpoint: could not delete %s (%s); the next run will", names, error)
            return
        if not background:
            for path in trash:
                shutil.rmtree(path, ignore_errors=True)
            return
        if self._trash_remover is None:
            self._trash_remover = ThreadPoolExecutor(1, thread_name_prefix="ckpt-trash-remover")
        for path in trash:
            self._trash_remover.submit(shutil.rmtree, path, ignore_errors=True)

    def _link_last(self, name: str | None) -> None:
        """Point `<name>-last` at `name` (atomically) and remove every other `-last` link."""
        link = self.dirpath / f"{name}{LAST_SUFFIX}" if name else None
        if link is not None:
            tmp_link = self.dirpath / f"{TMP_PREFIX}{name}{LAST_SUFFIX}"
            tmp_link.unlink(missing_ok=True)
            tmp_link.symlink_to(name, target_is_directory=True)
            os.replace(tmp_link, link)
        for other in self.dirpath.glob(f"*{LAST_SUFFIX}"):
            if other.is_symlink() and other != link:
                other.unlink()

    def stale_checkpoints(self, manifest: Manifest) -> list[CheckpointRecord]:
        """Complete checkpoints of this run's lineage that nothing keeps: not top-k, not the best, not `-last` or the
        newest resumable. Checkpoints another lineage wrote are never deleted."""
        complete = [record for record in manifest.complete() if record.lineage == self.lineage]
        if self.save_top_k == -1:
            return []
        ranked = self._ranked(complete)
        keep = {record.name for record in ranked[: self.save_top_k]}
        if self.save_best_model and ranked:
            keep.add(ranked[0].name)
        if self.save_last and complete:
            keep.add(complete[-1].name)
            resumable = [record for record in complete if not record.weights_only]
            if resumable:
                keep.add(resumable[-1].name)
        return [record for record in complete if record.name not in keep]

    def _ranked(self, records: list[CheckpointRecord]) -> list[CheckpointRecord]:
        """Best first: by `monitor` (NaN is worst, records without it are not ranked), else newest first."""
        if not self.monitor:
            return records[::-1]
        worst = float("inf") if self.mode == "min" else float("-inf")

        def score(record: CheckpointRecord) -> float:
            value = record.metrics[self.monitor]
            return worst if value != value else value

        ranked = [record for record in records if self.monitor in record.metrics]
        return sorted(ranked, key=score, reverse=self.mode == "max")

    # Recovery

    def _check_writable(self) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        probe = self.dirpath / f"{TMP_PREFIX}write-probe"
        with open(probe, "w") as handle:
            handle.write("ok")
            handle.flush()
            os.fsync(handle.fileno())
        probe.unlink()

    def recover(self, resumed: bool) -> None:
        """Finish or roll back what a crashed run left in flight, so that every record is true again.

        Removes `.tmp-*` (unfinished saves) and `.trash-*` (unfinished deletions); a `saving` record whose
        directory is complete was committed just before the crash and becomes `complete`; `deleting` records are
        deleted; records of missing checkpoints are dropped. A run that did not resume refuses a directory that
        holds complete checkpoints: its saves would mix with, and its top-k would delete, another run's.
        """
        manifest = Manifest.read(self.dirpath)
        if not resumed and manifest.complete():
            raise FileExistsError(
                f"{self.dirpath} holds {len(manifest.complete())} checkpoints of an earlier run, and this run did not "
                "resume from one; resume it (AutoResume(resume_if_exists=True)), or choose another dirpath or log "
                "name, or remove them"
            )
        for entry in self.dirpath.iterdir():
            if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                log.warning("ModelCheckpoint: removing %s, left by an interrupted save or deletion", entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        deleting = []
        for record in list(manifest.checkpoints):
            if record.state == "deleting":
                deleting.append(record.name)
            elif is_complete(self.dirpath / record.name):
                record.state = "complete"
            else:
                log.warning(
                    "ModelCheckpoint: dropping %s from %s: %s",
                    record.name,
                    self.dirpath,
                    "its save did not finish" if record.state == "saving" else "it is missing or incomplete",
                )
                manifest.remove(record.name)
        newest = manifest.newest()
        manifest.last = newest.name if self.save_last and newest else None
        pause_point("recover")
        manifest.write(self.dirpath)
        self._link_last(manifest.last)
        self._delete(deleting)

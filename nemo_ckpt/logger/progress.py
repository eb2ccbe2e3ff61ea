"""`ProgressPrinter`: NeMo-style progress lines on global rank 0 (a tqdm bar instead when stdout is a terminal)."""

import logging
import math
import sys
from typing import Any, TextIO

import lightning.pytorch as pl
import torch
from tqdm import tqdm

from nemo_ckpt.data.base import SampledDataModule
from nemo_ckpt.logger.metrics import StepMetrics

PROGRESS_LOGGER = "nemo_ckpt.progress"
"""The logger of the progress lines: its own console handler (no propagation) and the run's text log."""


def _value(metrics: dict[str, Any], name: str) -> float | None:
    value = metrics.get(name)
    if isinstance(value, torch.Tensor):
        value = value.item()
    return None if value is None else float(value)


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:{spec}}{unit}"


class _TqdmHandler(logging.Handler):
    """Writes records above a tqdm bar instead of through it."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=self.stream)


class ProgressPrinter(pl.Callback):
    """On global rank 0: the resume point, then every `trainer.log_every_n_steps` optimizer steps a line

        iteration 12/20 | consumed_samples 96 | lr 2.900e-03 | reduced_train_loss 4.612 | grad_norm 1.204 |
        step_time 0.210s | tokens/s 1220 | TFLOP/s/device 0.002 | MFU n/a | mem 0.41 GiB (peak RSS)

    (one line), and validation results when they happen. Values come from `trainer.callback_metrics` (what the
    model logged) and `step_metrics` (time, throughput, FLOPs, memory). When `stream` (default: stdout) is a
    terminal, a tqdm bar shows the steps and the lines are printed above it; otherwise plain lines (Slurm logs, CI).
    """

    def __init__(self, step_metrics: StepMetrics, stream: TextIO | None = None) -> None:
        self.step_metrics = step_metrics
        self.stream = stream
        self._logger = logging.getLogger(PROGRESS_LOGGER)
        self._handler: logging.Handler | None = None
        self._bar: tqdm | None = None
        self._printed_step = -1

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not trainer.is_global_zero or self._handler is not None:
            return
        stream = self.stream or sys.stdout
        self._handler = _TqdmHandler(stream) if stream.isatty() else logging.StreamHandler(stream)
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.INFO)
        self._logger.propagate = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._handler is not None:
            self._logger.removeHandler(self._handler)
            self._handler = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if trainer.ckpt_path:
            consumed = self._consumed_samples(trainer)
            self._logger.info(
                f"resuming from {trainer.ckpt_path} at step {trainer.global_step}"
                + ("" if consumed is None else f", consumed_samples {consumed}")
            )
        if isinstance(self._handler, _TqdmHandler):
            self._bar = tqdm(
                total=trainer.max_steps if trainer.max_steps > 0 else None,
                initial=trainer.global_step,
                desc="training",
                unit="step",
                file=self._handler.stream,
                dynamic_ncols=True,
            )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        record = self.step_metrics.last
        if not trainer.is_global_zero or record is None or record.step != trainer.global_step:
            return
        if record.step == self._printed_step:
            return
        self._printed_step = record.step
        if self._bar is not None:
            self._bar.update(record.step - self._bar.n)
        last = trainer.max_steps > 0 and record.step >= trainer.max_steps
        if record.step % trainer.log_every_n_steps and not last:
            return
        self._logger.info(self.format_line(trainer, dict(trainer.callback_metrics)))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        metrics = dict(trainer.callback_metrics)
        values = [f"{name} {_fmt(_value(metrics, name), '.4g')}" for name in sorted(metrics) if name.startswith("val")]
        self._logger.info(f"validation at iteration {trainer.global_step} | " + " | ".join(values or ["no metrics"]))

    def format_line(self, trainer: pl.Trainer, metrics: dict[str, Any]) -> str:
        """The progress line of the step `step_metrics.last` describes."""
        record = self.step_metrics.last
        max_steps = trainer.max_steps if trainer.max_steps > 0 else "?"
        consumed = self._consumed_samples(trainer)
        fields = [
            f"iteration {record.step}/{max_steps}",
            f"consumed_samples {consumed if consumed is not None else 'n/a'}",
            f"lr {_fmt(_value(metrics, 'lr'), '.3e')}",
            f"reduced_train_loss {_fmt(_value(metrics, 'reduced_train_loss'), '.4g')}",
            f"grad_norm {_fmt(_value(metrics, 'grad_norm'), '.4g')}",
            f"step_time {record.step_time:.3f}s",
            f"tokens/s {record.tokens_per_sec:.0f}",
            f"TFLOP/s/device {_fmt(record.tflops_per_device, '.3g')}",
            f"MFU {_fmt(None if record.mfu is None else 100 * record.mfu, '.1f', '%')}",
            f"mem {record.memory:.2f} GiB ({record.memory_kind})",
        ]
        return " | ".join(fields)

    def _consumed_samples(self, trainer: pl.Trainer) -> int | None:
        """Samples trained on so far: the data module's count (the one its checkpoints store and its sampler starts
        after), else `global_step` x the last step's samples."""
        datamodule = trainer.datamodule
        if isinstance(datamodule, SampledDataModule):
            return datamodule.consumed_samples()
        if self.step_metrics.last is None:
            return None
        return trainer.global_step * self.step_metrics.last.samples

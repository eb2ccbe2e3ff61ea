"""`StepMetrics`: per-step time, throughput, TFLOP/s, MFU and memory, logged to every logger of the Trainer."""

import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch

from nemo_ckpt.logger.flops import peak_flops_per_device, training_flops_per_token
from nemo_ckpt.models.gpt.model import GPTConfig
from nemo_ckpt.parallel.mesh import parallel_dims_of

GIB = 2**30


@dataclass
class StepRecord:
    """What one optimizer step took: the values `StepMetrics` logs (None where unknown)."""

    step: int
    step_time: float
    samples: int
    tokens: int
    tokens_per_sec: float
    tflops_per_device: float | None
    mfu: float | None
    memory: float
    memory_kind: str


def peak_memory(device: torch.device) -> tuple[float, str]:
    """This process's peak memory in GiB: CUDA max allocated on a GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB, "max allocated"
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return max_rss * (1 if sys.platform == "darwin" else 1024) / GIB, "peak RSS"


class StepMetrics(pl.Callback):
    """Logs, for every optimizer step, `step_time` (s: first micro-batch start to last micro-batch end, so data
    loading, validation and checkpoint saves between steps are not in it), `tokens_per_sec` (all ranks),
    `tflops_per_device` (model FLOPs of the GPT from its config, `nemo_ckpt.logger.flops`, per second and device),
    `mfu` (that over the device's peak, when known) and `memory` (GiB, `peak_memory`).

    The latest step is kept as `last` for the console progress line. `peak_tflops_per_device` overrides the peak
    looked up for the device (and gives an MFU on CPU).
    """

    def __init__(self, peak_tflops_per_device: float | None = None) -> None:
        self.peak_tflops_per_device = peak_tflops_per_device
        self.last: StepRecord | None = None
        self._step_start: float | None = None
        self._samples = 0
        self._tokens = 0
        self._seen_step = 0
        self._flops_per_token: int | None = None
        self._peak_flops: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = getattr(pl_module, "config", None)
        self._flops_per_token = training_flops_per_token(config) if isinstance(config, GPTConfig) else None
        if self.peak_tflops_per_device is not None:
            self._peak_flops = self.peak_tflops_per_device * 1e12
        else:
            self._peak_flops = peak_flops_per_device(trainer.strategy.root_device, trainer.precision)
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step
        self._step_start = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args) -> None:
        if self._step_start is None:
            self._synchronize(trainer)
            self._step_start = time.perf_counter()
            self._samples = self._tokens = 0
        tokens = batch.get("tokens") if isinstance(batch, dict) else None
        if isinstance(tokens, torch.Tensor):
            self._samples += tokens.shape[0]
            self._tokens += tokens.numel()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        if trainer.global_step == self._seen_step or self._step_start is None:
            return  # accumulating gradients: the optimizer step is not done yet
        self._synchronize(trainer)
        step_time = time.perf_counter() - self._step_start
        self._step_start = None
        self._seen_step = trainer.global_step
        self.last = self._record(trainer, step_time)
        values = {"step_time": step_time, "tokens_per_sec": self.last.tokens_per_sec, "memory": self.last.memory}
        if self.last.tflops_per_device is not None:
            values["tflops_per_device"] = self.last.tflops_per_device
        if self.last.mfu is not None:
            values["mfu"] = self.last.mfu
        for name, value in values.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def _record(self, trainer: pl.Trainer, step_time: float) -> StepRecord:
        dims = parallel_dims_of(trainer)
        replicas = dims.dp  # ranks that see different data
        tokens = self._tokens * replicas * dims.cp  # a cp rank holds 1/cp of its sequences' tokens
        tflops = mfu = None
        if self._flops_per_token is not None:
            flops_per_device = self._flops_per_token * tokens / trainer.world_size / step_time
            tflops = flops_per_device / 1e12
            mfu = flops_per_device / self._peak_flops if self._peak_flops else None
        memory, kind = peak_memory(trainer.strategy.root_device)
        return StepRecord(
            step=trainer.global_step,
            step_time=step_time,
            samples=self._samples * replicas,
            tokens=tokens,
            tokens_per_sec=tokens / step_time,
            tflops_per_device=tflops,
            mfu=mfu,
            memory=memory,
            memory_kind=kind,
        )

    @staticmethod
    def _synchronize(trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

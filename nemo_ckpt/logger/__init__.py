"""Where a run writes its logs and checkpoints (`NeMoLogger`), and what it shows while it trains: per-step metrics
(`StepMetrics`), the console progress line (`ProgressPrinter`), model FLOPs (`flops`), and the `plot` and `runs`
commands (`python -m nemo_ckpt plot|runs`, which do not load Lightning).

Names are imported on first use; Lightning's start-up notices are kept off the console from when `text_log` (which
`NeMoLogger` uses) is imported."""

from nemo_ckpt._lazy import lazy_exports

_EXPORTS: dict[str, str | None] = {
    "NeMoLogger": "nemo_ckpt.logger.nemo_logger",
    "ProgressPrinter": "nemo_ckpt.logger.progress",
    "StepMetrics": "nemo_ckpt.logger.metrics",
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

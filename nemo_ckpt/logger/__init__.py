"""Where a run writes its logs and checkpoints (`NeMoLogger`), and what it shows while it trains: per-step metrics
(`StepMetrics`), the console progress line (`ProgressPrinter`), model FLOPs (`flops`), and the `plot` and `runs`
commands (`python -m nemo_ckpt plot|runs`)."""

from nemo_ckpt.logger.metrics import StepMetrics
from nemo_ckpt.logger.nemo_logger import NeMoLogger
from nemo_ckpt.logger.progress import ProgressPrinter
from nemo_ckpt.logger.text_log import quiet_console, verbose_requested

quiet_console(not verbose_requested())

__all__ = ["NeMoLogger", "ProgressPrinter", "StepMetrics"]

"""Where a run writes its logs and checkpoints (`NeMoLogger`)."""

from nemo_ckpt.logger.nemo_logger import NeMoLogger

__all__ = ["NeMoLogger"]

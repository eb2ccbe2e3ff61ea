"""NeMo 2.0-style training on plain PyTorch, with Megatron-Core-compatible distributed checkpoints.

    from nemo_ckpt import MegatronStrategy, ModelCheckpoint, AutoResume, NeMoLogger, pretrain, dist_checkpointing

- `MegatronStrategy`: the Lightning strategy (DDP, ZeRO-1, FSDP2, tensor parallelism, `ckpt_*` options).
- `DistributedDataParallelConfig`: how the strategy shards and synchronizes data-parallel training.
- `ModelCheckpoint`: when checkpoints are saved, which are kept; atomic commits and crash recovery.
- `AutoResume`: which checkpoint a run continues from.
- `NeMoLogger`: where a run writes its logs and checkpoints.
- `OptimizerConfig`: the optimizer and learning-rate schedule, with Megatron-Core's names.
- `pretrain`: the entry point recipes target, like NeMo's `llm.pretrain`.
- `dist_checkpointing`: the sharded checkpoint library, a drop-in for `megatron.core.dist_checkpointing`.

Names are imported on first use, so `from nemo_ckpt import dist_checkpointing` does not load Lightning.
"""

import importlib
from typing import Any

_EXPORTS = {
    "AutoResume": "nemo_ckpt.checkpoint.resume",
    "DistributedDataParallelConfig": "nemo_ckpt.parallel.ddp_config",
    "MegatronStrategy": "nemo_ckpt.strategy.megatron_strategy",
    "ModelCheckpoint": "nemo_ckpt.checkpoint.model_checkpoint",
    "NeMoLogger": "nemo_ckpt.logger.nemo_logger",
    "OptimizerConfig": "nemo_ckpt.optim",
    "pretrain": "nemo_ckpt.api",
}

__all__ = [*_EXPORTS, "dist_checkpointing"]


def __getattr__(name: str) -> Any:
    """Import an exported name on first use (PEP 562)."""
    if name == "dist_checkpointing":
        return importlib.import_module("nemo_ckpt.dist_checkpointing")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nemo_ckpt' has no attribute {name!r}")

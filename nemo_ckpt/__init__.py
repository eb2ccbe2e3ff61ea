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

from nemo_ckpt._lazy import lazy_exports

_EXPORTS: dict[str, str | None] = {
    "AutoResume": "nemo_ckpt.checkpoint.resume",
    "DistributedDataParallelConfig": "nemo_ckpt.parallel.ddp_config",
    "MegatronStrategy": "nemo_ckpt.strategy.megatron_strategy",
    "ModelCheckpoint": "nemo_ckpt.checkpoint.model_checkpoint",
    "NeMoLogger": "nemo_ckpt.logger.nemo_logger",
    "OptimizerConfig": "nemo_ckpt.optim",
    "pretrain": "nemo_ckpt.api",
    "dist_checkpointing": None,
}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

"""Parallelism on torch: the options (`ParallelismConfig`), the layout (`ParallelDims`: sizes, meshes, ranks),
their composition in one order (`plan.parallelize`), and each parallelism with its checkpoint rule: DDP, ZeRO-1,
FSDP2, tensor, pipeline, context and expert parallelism, meta-device init."""

from nemo_ckpt.parallel.config import ParallelismConfig
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig

__all__ = ["DistributedDataParallelConfig", "ParallelismConfig"]

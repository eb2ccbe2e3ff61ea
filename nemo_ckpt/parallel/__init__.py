"""Parallelism on torch: the device mesh, DDP, ZeRO-1, FSDP2, tensor parallelism, meta-device init and their
configuration (`DistributedDataParallelConfig`)."""

from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig

__all__ = ["DistributedDataParallelConfig"]

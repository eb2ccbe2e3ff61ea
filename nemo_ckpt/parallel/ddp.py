"""DDP (`no_shard`, and under ZeRO-1 `optim`) configured from `DistributedDataParallelConfig`."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig


@dataclass
class GradReduceState:
    """What `reduce_gradients` needs: the data-parallel group, the reduction dtype and how to average."""

    process_group: dist.ProcessGroup
    reduce_dtype: torch.dtype | None
    average_in_collective: bool


def reduce_gradients(state: GradReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average a gradient bucket in `reduce_dtype`, with AVG where the backend has it."""
    grads = bucket.buffer()
    reduced = grads.to(state.reduce_dtype) if state.reduce_dtype not in (None, grads.dtype) else grads
    if state.average_in_collective and dist.get_backend(state.process_group) == "nccl":
        op = dist.ReduceOp.AVG
    else:
        reduced.div_(state.process_group.size())
        op = dist.ReduceOp.SUM
    work = dist.all_reduce(reduced, op=op, group=state.process_group, async_op=True)

    def write_back(future: torch.futures.Future) -> torch.Tensor:
        result = future.value()[0]
        if result is not grads:
            grads.copy_(result)
        return grads

    return work.get_future().then(write_back)


def apply_ddp(
    module: nn.Module,
    mesh: DeviceMesh,
    config: DistributedDataParallelConfig,
    device_ids: list[int] | None,
    grad_dtype: torch.dtype,
    reduce_dtype: torch.dtype | None,
    **ddp_kwargs: Any,
) -> DistributedDataParallel:
    """Wrap `module` in DDP over `mesh`: buckets of `config.bucket_size` elements when `overlap_grad_reduce`,
    else one bucket reduced after backward; reduced in `reduce_dtype` (None: the gradient dtype)."""
    total = sum(param.numel() for param in module.parameters() if param.requires_grad)
    bucket_cap_mb = config.ddp_bucket_cap_mb(mesh.size(), grad_dtype.itemsize, total)
    ddp = DistributedDataParallel(
        module, device_ids=device_ids, process_group=mesh.get_group(), bucket_cap_mb=bucket_cap_mb, **ddp_kwargs
    )
    group = mesh.get_group()
    in_collective = config.average_in_collective and dist.get_backend(group) == "nccl"
    if reduce_dtype not in (None, grad_dtype) or in_collective:
        ddp.register_comm_hook(GradReduceState(group, reduce_dtype, config.average_in_collective), reduce_gradients)
    return ddp

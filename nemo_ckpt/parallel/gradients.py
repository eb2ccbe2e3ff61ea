"""Gradient synchronization outside DDP/FSDP: averaging DTensor gradients over dp, and the NaN/Inf check."""

import torch
import torch.distributed as dist
from torch import nn

from nemo_ckpt.dist_checkpointing.dtensor import local_tensor


class GradientAllReducer:
    """Data parallelism for tensor-parallel DTensor parameters, whose gradients DDP cannot reduce: averages each
    gradient's local shard over the data-parallel `group`.

    With `overlap_grad_reduce`, a gradient's all-reduce starts as soon as backward has accumulated it (one
    parameter per bucket) and `finish()` waits for them; without, `finish()` reduces all gradients in one
    coalesced all-reduce. Call `finish()` after every backward; averaging again after gradient accumulation
    is exact, as the reduced part is already equal on every rank.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, overlap_grad_reduce: bool) -> None:
        self.module = module
        self.group = group
        self.pending: list[tuple[torch.Tensor, dist.Work]] = []
        if overlap_grad_reduce:
            for param in module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._start_all_reduce)

    def _start_all_reduce(self, param: torch.Tensor) -> None:
        grad = local_tensor(param.grad)
        self.pending.append((grad, dist.all_reduce(grad, group=self.group, async_op=True)))

    @torch.no_grad()
    def finish(self) -> None:
        """Complete the averaging of every gradient."""
        if self.pending:
            for grad, work in self.pending:
                work.wait()
                grad.div_(self.group.size())
            self.pending.clear()
            return
        grads = [local_tensor(param.grad) for param in self.module.parameters() if param.grad is not None]
        if not grads:
            return
        flat = torch.cat([grad.flatten() for grad in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.group.size())
        for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads])):
            grad.copy_(reduced.view_as(grad))


def check_grads_finite(module: nn.Module, group: dist.ProcessGroup, step: int) -> None:
    """Raise on every rank, naming the parameters, if any rank holds a NaN or Inf gradient."""
    named_grads = [
        (name, local_tensor(param.grad)) for name, param in module.named_parameters() if param.grad is not None
    ]
    finite = torch.stack([grad.isfinite().all() for _, grad in named_grads]) if named_grads else None
    flag = torch.zeros(1, device=next(module.parameters()).device)
    if finite is not None:
        flag[0] = (~finite).any().float()
    dist.all_reduce(flag, group=group)
    if flag.item():
        bad = [name for (name, _), ok in zip(named_grads, finite.tolist()) if not ok] if finite is not None else []
        raise RuntimeError(
            f"check_for_nan_in_grad: NaN or Inf gradients at step {step} on rank {dist.get_rank()} in "
            f"{bad or 'no local parameter (another rank found them)'}; lower the learning rate, clip gradients or "
            "inspect the data of this step"
        )

"""Optimizer and learning-rate schedule, configured with Megatron-Core's `OptimizerConfig` names."""

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


@dataclass
class OptimizerConfig:
    """AdamW (or SGD) with linear warmup and cosine or constant decay."""

    optimizer: str = "adam"
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "cosine"
    lr_decay_steps: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"OptimizerConfig.optimizer={self.optimizer!r}: use 'adam' or 'sgd'")
        if self.lr_decay_style not in ("cosine", "constant"):
            raise ValueError(f"OptimizerConfig.lr_decay_style={self.lr_decay_style!r}: use 'cosine' or 'constant'")

    def build_optimizer(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            # fused: one pass over each tensor (as Megatron-Core's FusedAdam); torch's default on CPU, a loop over
            # the parameters, allocates two temporaries of each parameter's size every step
            return torch.optim.AdamW(
                params,
                lr=self.lr,
                betas=(self.adam_beta1, self.adam_beta2),
                eps=self.adam_eps,
                weight_decay=self.weight_decay,
                fused=True,
            )
        return torch.optim.SGD(params, lr=self.lr, momentum=self.sgd_momentum, weight_decay=self.weight_decay)

    def lr_factor(self, step: int, decay_steps: int) -> float:
        """Learning rate at `step` as a fraction of `lr`."""
        if step < self.lr_warmup_steps:
            return (step + 1) / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return 1.0
        progress = min(1.0, (step - self.lr_warmup_steps) / max(1, decay_steps - self.lr_warmup_steps))
        min_factor = self.min_lr / self.lr
        return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def build_scheduler(self, optimizer: torch.optim.Optimizer, max_steps: int) -> "LRSchedule":
        decay_steps = self.lr_decay_steps or max_steps
        return LRSchedule(optimizer, lambda step: self.lr_factor(step, decay_steps))


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A `LambdaLR` whose loaded state sets only the step it is at: the learning rate is then this schedule's at that
    step, from the run's own config, which may differ from the checkpoint's (a run extended to more steps decays
    over its new `max_steps`; a changed `lr` applies). The first step after a resume trains with it."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        base_lrs = list(self.base_lrs)
        stored = list(state_dict.get("_last_lr") or [])
        super().load_state_dict(state_dict)
        self.base_lrs = base_lrs
        self._last_lr = [base * factor(self.last_epoch) for base, factor in zip(base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr
        if stored and any(not math.isclose(new, old) for new, old in zip(self._last_lr, stored)):
            log.info(
                "LR schedule: step %d trains with lr %.4g, this run's schedule (its checkpoint's run had %.4g)",
                self.last_epoch,
                self._last_lr[0],
                stored[0],
            )


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients in place so that their global L2 norm is at most `max_norm`; return that norm
    (before clipping) as a plain tensor, the same on every rank.

    Fused (`foreach`) norms and scaling, also for sharded (DTensor) gradients, for which torch's default
    (`foreach=None`) falls back to one norm and one multiply per parameter; DTensor sums the partial norms of
    the shards with one all-reduce.
    """
    total = torch.nn.utils.clip_grad_norm_(
        [param for param in parameters if param.grad is not None], max_norm, foreach=True
    )
    return total.full_tensor() if isinstance(total, DTensor) else total

"""`check_for_nan_in_grad`: a NaN gradient on one rank stops every rank with a message naming the parameter."""

from typing import Any

import lightning.pytorch as pl
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import fit


class PoisonGradient(pl.Callback):
    """Put a NaN into one gradient element on rank 1 at step 2."""

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 2 and trainer.global_rank == 1:
            grad = pl_module.module.layers[1].mlp.down_proj.weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = torch.nan


def train_until_nan(rank: int, world_size: int, strategy: str) -> str:
    ddp: dict[str, Any] = {"data_parallel_sharding_strategy": strategy, "check_for_nan_in_grad": True}
    try:
        fit(world_size, ddp, 5, callbacks=[PoisonGradient()])
    except RuntimeError as error:
        return str(error)
    return "trained without an error"


def test_nan_gradient_on_one_rank_stops_all_ranks():
    for strategy in ("optim_grads_params", "no_shard"):
        messages = run_distributed(train_until_nan, 2, strategy)
        assert "NaN or Inf gradients at step 2 on rank 1 in ['module.layers.1.mlp.down_proj.weight']" in messages[1]
        assert "NaN or Inf gradients at step 2 on rank 0" in messages[0], strategy

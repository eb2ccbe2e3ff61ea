"""bf16 mixed precision (`Trainer(precision="bf16-mixed")`): bf16 compute, fp32 master weights and optimizer
state, gradients in fp32; the loss follows fp32 training closely."""

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import fit

STEPS = 8


class RecordDtypes(pl.Callback):
    """Dtypes of the first MLP projection: its output in forward, its weight, gradient and optimizer state."""

    def __init__(self) -> None:
        self.dtypes: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        projection = pl_module.module.layers[0].mlp.up_proj
        projection.register_forward_hook(
            lambda module, args, output: self.dtypes.update(compute=output.dtype, weight_in_forward=module.weight.dtype)
        )

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        weight = pl_module.module.layers[0].mlp.up_proj.weight
        self.dtypes.update(master=weight.dtype, grad=weight.grad.dtype, sharded=isinstance(weight, DTensor))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self.dtypes["optimizer_state"] = {
            value.dtype for state in optimizer.state.values() for value in state.values() if value.dim() > 0
        }


def train_bf16(rank: int, world_size: int) -> dict[str, Any]:
    results = {"fp32": fit(world_size, {"data_parallel_sharding_strategy": "no_shard"}, STEPS)}
    for strategy, grad_reduce_in_fp32 in [
        ("no_shard", False),
        ("optim", True),
        ("optim_grads_params", True),
        ("optim_grads_params", False),
    ]:
        recorder = RecordDtypes()
        ddp = {"data_parallel_sharding_strategy": strategy, "grad_reduce_in_fp32": grad_reduce_in_fp32}
        losses = fit(world_size, ddp, STEPS, precision="bf16-mixed", callbacks=[recorder])
        results[(strategy, grad_reduce_in_fp32)] = (losses, recorder.dtypes)
    return results


def test_bf16_compute_with_fp32_master_weights_follows_fp32_training():
    [results] = run_distributed(train_bf16, 2)[:1]
    fp32 = results.pop("fp32")
    for (strategy, grad_reduce_in_fp32), (losses, dtypes) in results.items():
        name = f"{strategy}, grad_reduce_in_fp32={grad_reduce_in_fp32}"
        assert dtypes["compute"] == torch.bfloat16, name
        assert dtypes["master"] == dtypes["grad"] == torch.float32, name
        assert dtypes["optimizer_state"] == {torch.float32}, name
        assert dtypes["sharded"] == (strategy == "optim_grads_params"), name
        if strategy == "optim_grads_params":
            assert dtypes["weight_in_forward"] == torch.bfloat16, f"{name}: FSDP2 all-gathers bf16 weights"
        assert losses == pytest.approx(fp32, abs=3e-2), name
        assert losses != fp32, f"{name}: bf16 compute is not fp32"

"""`strategy.state_dict`: FSDP2 DTensors as `ShardedTensor`s (uneven and empty shards save and load across world
sizes); the optimizer's state and settings restored."""

from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.strategy.state_dict import (
    init_optimizer_state,
    load_module_state,
    load_named_optimizer_state,
    model_sharded_state_dict,
    named_optimizer_state,
    optimizer_sharded_state_dict,
)
from tests.helpers.distributed import run_distributed


def sharded_model(world_size: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 3), nn.Linear(3, 8))  # 3 rows over 4 ranks: 1, 1, 1 and an empty shard
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    names = {param: name for name, param in model.named_parameters()}
    model_sharded = model_sharded_state_dict(model.state_dict(), replica_id=0)
    optim_sharded = optimizer_sharded_state_dict(named_optimizer_state(optimizer, names), model_sharded)
    return {"model": model_sharded, "optimizer": optim_sharded}


def save_then_load(rank: int, world_size: int, directory: Path) -> dict[str, bool]:
    model, optimizer = sharded_model(world_size, seed=0)
    dist_checkpointing.save(state(model, optimizer), directory)
    restored, restored_optimizer = sharded_model(world_size, seed=1)
    init_optimizer_state(restored_optimizer)
    names = {param: name for name, param in restored.named_parameters()}
    loaded = dist_checkpointing.load(state(restored, restored_optimizer), directory)
    load_module_state(restored, loaded["model"])
    load_named_optimizer_state(restored_optimizer, names, loaded["optimizer"])
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    exp_avg = {names[p]: s["exp_avg"].full_tensor() for p, s in restored_optimizer.state.items()}
    saved_exp_avg = {name: optimizer.state[p]["exp_avg"].full_tensor() for name, p in model.named_parameters()}
    return {
        "rank_holds_rows": model[0].weight.to_local().shape[0] > 0,
        "weights": all(torch.equal(p.full_tensor(), full[name]) for name, p in restored.named_parameters()),
        "exp_avg": all(torch.equal(exp_avg[name], saved_exp_avg[name]) for name in saved_exp_avg),
        "step": all(float(s["step"]) == 1.0 for s in restored_optimizer.state.values()),
        "plain": rank != 0
        or all(torch.equal(dist_checkpointing.load_plain_tensors(directory)[name], full[name]) for name in full),
    }


def test_uneven_and_empty_shards_round_trip_on_4_ranks(tmp_path):
    results = run_distributed(save_then_load, 4, tmp_path)
    assert [result["rank_holds_rows"] for result in results] == [True, True, True, False]
    for result in results:
        assert result["weights"] and result["exp_avg"] and result["step"] and result["plain"]


def test_optimizer_load_restores_hyperparameters_and_keeps_the_live_implementation():
    param = nn.Parameter(torch.ones(4))
    saved = torch.optim.AdamW([param], lr=0.5, betas=(0.7, 0.8), foreach=False)
    param.grad = torch.ones(4)
    saved.step()
    live_param = nn.Parameter(torch.zeros(4))
    live = torch.optim.AdamW([live_param], lr=0.1, fused=True)
    init_optimizer_state(live)

    load_named_optimizer_state(live, {live_param: "w"}, named_optimizer_state(saved, {param: "w"}))

    group = live.param_groups[0]
    assert (group["lr"], group["betas"]) == (0.5, (0.7, 0.8))
    assert (group["fused"], group["foreach"]) == (True, None)
    assert torch.equal(live.state[live_param]["exp_avg"], saved.state[param]["exp_avg"])
    assert float(live.state[live_param]["step"]) == 1.0

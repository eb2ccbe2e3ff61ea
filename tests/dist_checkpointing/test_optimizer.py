"""Optimizer helpers: Adam state of a TP-sharded model saved on 2 ranks, loaded whole on 1."""

import itertools

import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import LocalNonpersistentObject, ShardedTensor
from nemo_ckpt.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state
from tests.helpers.distributed import run_distributed

FULL_W = torch.arange(24, dtype=torch.float32).view(6, 4) / 10
FULL_B = torch.ones(4)


def _model_and_optimizer(w: torch.Tensor, b: torch.Tensor):
    w, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    return w, b, torch.optim.Adam([{"params": [w]}, {"params": [b], "lr": 0.01}], lr=0.1)


def _sharded(w, b, opt, rank, ws):
    model_sd = {  # built from the parameters themselves (like state_dict(keep_vars=True))
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, ws)),
        "b": ShardedTensor.from_rank_offsets("b", b, replica_id=rank),
    }
    params = itertools.chain.from_iterable(g["params"] for g in opt.param_groups)
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_sd = opt.state_dict()
    optim_state_to_sharding_state(optim_sd, id_map)
    return model_sd, optim_sd


def _train_and_save(rank: int, ws: int, ckpt: str) -> list:
    rows = 6 // ws
    w, b, opt = _model_and_optimizer(FULL_W[rank * rows : (rank + 1) * rows], FULL_B)
    for step in range(2):
        w.grad = torch.full_like(w, 0.5 * (rank + 1) + step)
        b.grad = torch.full_like(b, 0.25 + step)
        opt.step()
    model_sd, optim_sd = _sharded(w, b, opt, rank, ws)
    assert isinstance(optim_sd["state"][0]["exp_avg"], ShardedTensor)
    assert optim_sd["state"][0]["exp_avg"].key == "optimizer.state.exp_avg.w"
    assert isinstance(optim_sd["param_groups"][0]["params"], LocalNonpersistentObject)
    dc.save({"model": model_sd, "optimizer": optim_sd}, ckpt)
    return [w.detach().clone(), b.detach().clone(), opt.state_dict()["state"]]


def test_adam_state_reshards_from_two_ranks_to_one(tmp_path):
    saved = run_distributed(_train_and_save, 2, str(tmp_path))

    w, b, opt = _model_and_optimizer(torch.zeros(6, 4), torch.zeros(4))
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    opt.step()  # materialize the state so it can serve as a load template
    model_sd, optim_sd = _sharded(w, b, opt, rank=0, ws=1)
    loaded = dc.load({"model": model_sd, "optimizer": optim_sd}, tmp_path)
    opt.load_state_dict(loaded["optimizer"])

    assert torch.equal(w.detach(), torch.cat([saved[0][0], saved[1][0]]))  # loaded in place into the params
    assert torch.equal(b.detach(), saved[0][1])
    state = opt.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[0][key], torch.cat([saved[0][2][0][key], saved[1][2][0][key]]))
        assert torch.equal(state[1][key], saved[0][2][1][key])
    assert state[0]["step"].item() == 2 and state[1]["step"].item() == 2
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    assert opt.state_dict()["param_groups"][0]["params"] == [0]

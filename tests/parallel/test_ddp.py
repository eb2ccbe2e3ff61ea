"""`apply_ddp` with the DDP options `MegatronStrategy` passes: buffers follow `broadcast_buffers` as in torch DDP,
and the default passes no option torch 2.13 warns about."""

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from nemo_ckpt.parallel.ddp import apply_ddp
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.distributed import run_distributed


def buffers_after_forward(rank: int, world_size: int, broadcast_buffers: bool) -> dict[str, object]:
    module = nn.BatchNorm1d(2)
    module.running_mean.fill_(rank)  # rank-local until DDP syncs it
    ddp_kwargs = MegatronStrategy(broadcast_buffers=broadcast_buffers)._ddp_kwargs
    mesh = init_device_mesh("cpu", (world_size,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = apply_ddp(module, mesh, DistributedDataParallelConfig(), None, torch.float32, None, **ddp_kwargs)
    ddp.eval()
    ddp(torch.zeros(3, 2))
    return {
        "running_mean": module.running_mean.tolist(),
        "future_warnings": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
    }


def test_buffers_are_synced_from_rank_0_by_default_without_a_deprecation_warning():
    results = run_distributed(buffers_after_forward, 2, True)
    assert [result["running_mean"] for result in results] == [[0.0, 0.0], [0.0, 0.0]]
    assert [result["future_warnings"] for result in results] == [[], []]


def test_broadcast_buffers_false_keeps_each_rank_s_buffers():
    results = run_distributed(buffers_after_forward, 2, False)
    assert [result["running_mean"] for result in results] == [[0.0, 0.0], [1.0, 1.0]]

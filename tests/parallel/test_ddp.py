"""`apply_ddp` with the DDP options `MegatronStrategy` passes: buffers follow `broadcast_buffers` as in torch DDP,
and the default passes no option torch 2.13 warns about."""

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from nemo_ckpt._compat import lightning_ddp_kwargs
from nemo_ckpt.parallel.ddp import apply_ddp
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.distributed import run_distributed


def buffers_after_forward(rank: int, world_size: int) -> dict[bool, dict[str, list]]:
    """Per `broadcast_buffers`: this rank's BatchNorm running mean after a forward, and the FutureWarnings seen."""
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for broadcast_buffers in (True, False):
        module = nn.BatchNorm1d(2)
        module.running_mean.fill_(rank)  # rank-local until DDP syncs it
        ddp_kwargs = lightning_ddp_kwargs(MegatronStrategy(broadcast_buffers=broadcast_buffers))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = apply_ddp(module, mesh, DistributedDataParallelConfig(), None, torch.float32, None, **ddp_kwargs)
        ddp.eval()
        ddp(torch.zeros(3, 2))
        results[broadcast_buffers] = {
            "running_mean": module.running_mean.tolist(),
            "future_warnings": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
        }
    return results


def test_buffers_follow_broadcast_buffers_and_the_default_warns_nothing():
    results = run_distributed(buffers_after_forward, 2)
    synced, local = [result[True] for result in results], [result[False] for result in results]
    assert [rank["running_mean"] for rank in synced] == [[0.0, 0.0], [0.0, 0.0]]  # rank 0's, at wrap and forward
    assert [rank["future_warnings"] for rank in synced] == [[], []]
    assert [rank["running_mean"] for rank in local] == [[0.0, 0.0], [1.0, 1.0]]

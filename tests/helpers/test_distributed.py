import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed


def _all_reduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_run_distributed_returns_each_rank_result():
    assert run_distributed(_all_reduce_rank, 2) == [1.0, 1.0]

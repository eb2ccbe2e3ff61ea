"""ZeRO-1 (`optim`): each rank keeps optimizer state for its own parameters only, and every rank ends each step
with the parameters a replicated optimizer would have computed."""

import copy

import torch
import torch.distributed as dist
from torch import nn

from nemo_ckpt.parallel.zero import ZeroOneSharding, assign_owners
from tests.helpers.distributed import run_distributed


def test_owners_balance_elements_largest_first():
    assert assign_owners([10, 1, 1, 8, 2], 2) == [0, 0, 1, 1, 1]
    assert assign_owners([4, 4, 4, 4], 4) == [0, 1, 2, 3]


def zero_steps(rank: int, world_size: int, overlap_param_gather: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1)
    zero = ZeroOneSharding(optimizer, model, dist.group.WORLD, overlap_param_gather)
    for step in range(3):
        inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))  # the same on every rank
        for module, opt in ((model, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            module(inputs).square().mean().backward()
            opt.step()
        model(inputs)  # the next forward waits for the overlapped broadcasts
    return {
        "state_params": sorted(name for name, p in model.named_parameters() if p in optimizer.state),
        "owned": sorted(name for name, p in model.named_parameters() if zero.owns(p)),
        "equal_to_replicated": all(
            torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), reference.parameters())
        ),
    }


def test_state_is_partitioned_and_parameters_match_a_replicated_optimizer():
    for overlap_param_gather in (False, True):
        results = run_distributed(zero_steps, 2, overlap_param_gather)
        for result in results:
            assert result["equal_to_replicated"]
            assert result["state_params"] == result["owned"] != []
        assert sorted(results[0]["owned"] + results[1]["owned"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]

"""Expert parallelism mechanics: all-to-all dispatch/combine on 2 gloo ranks against the unsplit layer."""

import copy

import pytest
import torch
import torch.distributed as dist

from nemo_ckpt.models.gpt.model import MLP, gpt_config
from nemo_ckpt.models.gpt.moe import MoELayer
from nemo_ckpt.parallel.expert_parallel import apply_expert_parallel, is_expert_key, local_expert_ids
from nemo_ckpt.parallel.mesh import ParallelDims
from tests.helpers.distributed import run_distributed

HIDDEN = 16


def _split_layer_matches_whole_layer(rank: int, world_size: int, starve_last_expert: bool) -> list[int]:
    torch.manual_seed(0)
    config = gpt_config(
        "tiny",
        hidden_size=HIDDEN,
        ffn_hidden_size=24,
        num_moe_experts=4,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001,
        moe_shared_expert_intermediate_size=8,
    )
    whole = MoELayer(config, lambda size: MLP(config, size)).double()
    hidden = torch.randn(world_size, 6, HIDDEN, dtype=torch.float64)  # every rank's tokens, the same everywhere
    if starve_last_expert:  # positive tokens, a negative router row: expert 3 gets no token on any rank
        hidden = hidden.abs()
        whole.router.weight.data[3] = -1.0
    grad_output = torch.randn_like(hidden)
    split = copy.deepcopy(whole)
    expert_mesh = ParallelDims(world_size, ep=world_size).build_expert_mesh("cpu")
    apply_expert_parallel(split, expert_mesh, dist.group.WORLD)

    # the whole layer on all tokens; the loss is the mean of the ranks' losses, as in data parallelism
    expected = whole(hidden.requires_grad_())
    expected.backward(grad_output / world_size)
    output = split(hidden[rank : rank + 1].detach())
    output.backward(grad_output[rank : rank + 1])

    torch.testing.assert_close(output[0], expected[rank].detach(), atol=1e-10, rtol=1e-10)
    for name, param in split.named_parameters():
        grad = param.grad / world_size
        if not is_expert_key(name):  # dense: each rank holds its tokens' part
            dist.all_reduce(grad)
        torch.testing.assert_close(grad, whole.get_parameter(name).grad, atol=1e-10, rtol=1e-10, msg=name)
    counts = split.last_metrics["tokens_per_expert"]
    torch.testing.assert_close(counts, whole.last_metrics["tokens_per_expert"])
    assert (counts[3] == 0) == starve_last_expert
    return split.local_expert_ids


def _both_cases(rank: int, world_size: int) -> list[list[int]]:
    return [_split_layer_matches_whole_layer(rank, world_size, starve) for starve in (False, True)]


def test_split_experts_compute_what_the_whole_layer_does():
    """Outputs, gradients and token counts; also with an expert no rank sends a token to (empty splits)."""
    assert run_distributed(_both_cases, 2) == [[[0, 1]] * 2, [[2, 3]] * 2]


def test_experts_split_in_contiguous_blocks_or_a_clear_error():
    assert local_expert_ids(8, 1, 4) == range(2, 4)
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 must divide num_moe_experts=8"):
        local_expert_ids(8, 0, 3)
    assert is_expert_key("module.layers.0.mlp.experts.3.up_proj.weight")
    assert not is_expert_key("module.layers.0.mlp.shared_experts.up_proj.weight")

"""Expert parallelism mechanics on 2 gloo ranks against the unsplit layer: all-to-all dispatch/combine, and
a MoE layer under tensor parallelism (experts sharded or whole, with and without sequence parallelism)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from nemo_ckpt.models.gpt.model import MLP, gpt_config
from nemo_ckpt.models.gpt.moe import MoELayer
from nemo_ckpt.models.gpt.parallelize import FeedForwardParallel, moe_layer_plan
from nemo_ckpt.parallel.expert_parallel import apply_expert_parallel, is_expert_key, local_expert_ids
from nemo_ckpt.parallel.mesh import ParallelDims
from tests.helpers.distributed import run_distributed

HIDDEN = 16


def _whole_layer() -> MoELayer:
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
    return MoELayer(config, lambda size: MLP(config, size)).double()


def _split_layer_matches_whole_layer(rank: int, world_size: int, starve_last_expert: bool) -> list[int]:
    whole = _whole_layer()
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


def _tensor_parallel_layer_matches_whole_layer(rank: int, world_size: int) -> None:
    tp_mesh = ParallelDims(world_size, tp=world_size).build_mesh("cpu")["tp"]
    for expert_tensor_parallel, sequence_parallel in ((True, False), (True, True), (False, True)):
        whole = _whole_layer()
        hidden = torch.randn(2, 6, HIDDEN, dtype=torch.float64)
        grad_output = torch.randn_like(hidden)
        split = copy.deepcopy(whole)
        split.expert_tensor_parallel = expert_tensor_parallel
        parallelize_module(split, tp_mesh, FeedForwardParallel(Shard(1) if sequence_parallel else Replicate()))

        expected = whole(hidden.requires_grad_())
        expected.backward(grad_output)
        shards = world_size if sequence_parallel else 1  # the tp rank's sequence shard, or all of it

        def part(tensor: torch.Tensor, shards: int = shards) -> torch.Tensor:
            return tensor.chunk(shards, dim=1)[rank % shards]

        inputs = part(hidden.detach()).requires_grad_()
        output = split(inputs)
        output.backward(part(grad_output))

        case = f"expert_tensor_parallel={expert_tensor_parallel}, sequence_parallel={sequence_parallel}"
        torch.testing.assert_close(output, part(expected.detach()), atol=1e-10, rtol=1e-10, msg=case)
        torch.testing.assert_close(inputs.grad, part(hidden.grad), atol=1e-10, rtol=1e-10, msg=case)
        for name, param in split.named_parameters():
            assert isinstance(param, DTensor), name
            if is_expert_key(name):
                assert param.placements[0].is_shard() == expert_tensor_parallel, name
            expected_grad = whole.get_parameter(name).grad
            torch.testing.assert_close(param.grad.full_tensor(), expected_grad, atol=1e-10, rtol=1e-10, msg=name)
        torch.testing.assert_close(split.last_metrics["tokens_per_expert"], whole.last_metrics["tokens_per_expert"])


def test_tensor_parallel_moe_layer_computes_what_the_whole_layer_does():
    """TP=2 with experts sharded (expert_tensor_parallel_size=2) or whole (1): outputs, input and parameter
    gradients (the router's through routing probabilities that weight partial expert outputs) and token counts."""
    run_distributed(_tensor_parallel_layer_matches_whole_layer, 2)


def test_experts_not_splitting_over_tensor_parallel_ranks_are_a_clear_error():
    layer = _whole_layer()  # experts of 24, a shared expert of 8
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=24 is not divisible by tensor_model_parallel_size=5.*"
                       "or set expert_tensor_parallel_size=1"):  # fmt: skip
        moe_layer_plan(layer, 5, Replicate())
    layer.expert_tensor_parallel = False
    with pytest.raises(ValueError, match="moe_shared_expert_intermediate_size=8 is not divisible"):
        moe_layer_plan(layer, 3, Replicate())
    assert set(moe_layer_plan(layer, 4, Replicate())) == {
        "router", "experts.*.gate_proj", "experts.*.up_proj", "experts.*.down_proj", "shared_experts.gate_proj",
        "shared_experts.up_proj", "shared_experts.down_proj",
    }  # fmt: skip

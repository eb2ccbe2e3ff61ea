"""DTensor -> ShardedTensor conversion, and checkpoints that reshard across TP, FSDP and TP x FSDP layouts."""

from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.dist_checkpointing.dtensor import dtensor_to_sharded_tensor
from nemo_ckpt.models.gpt import gpt_config
from nemo_ckpt.strategy.state_dict import (
    init_optimizer_state,
    load_module_state,
    load_named_optimizer_state,
    model_sharded_state_dict,
    named_optimizer_state,
    optimizer_sharded_state_dict,
)
from tests.helpers.distributed import run_distributed
from tests.helpers.tensor_parallel import build_model, full_model_and_optimizer_state, global_batches, train

PLACEMENTS = {
    "shard0_shard1": ((6, 8), (Shard(0), Shard(1))),
    "shard1_shard0": ((6, 8), (Shard(1), Shard(0))),
    "both_on_dim0": ((8, 3), (Shard(0), Shard(0))),
    "replicate_shard1": ((4, 6), (Replicate(), Shard(1))),
    "shard0_replicate": ((4, 6), (Shard(0), Replicate())),
    "replicated": ((5,), (Replicate(), Replicate())),
    "uneven": ((7, 5), (Shard(0), Shard(1))),
    "empty_shards": ((3, 2), (Shard(0), Shard(0))),
}


def convert_placements(rank: int, world_size: int, directory: str) -> dict[str, tuple]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sharded, offsets = {}, {}
    for name, (shape, placements) in PLACEMENTS.items():
        tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        sharded[name] = dtensor_to_sharded_tensor(name, distribute_tensor(tensor, mesh, placements))
    # FSDP over dp on top of TP over tp: torch records the dp shard of a colwise weight as _StridedShard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10, bias=False), torch.nn.Linear(10, 6, bias=False))
    reference = {f"fsdp_tp.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    sharded.update(
        {
            f"fsdp_tp.{key}": dtensor_to_sharded_tensor(f"fsdp_tp.{key}", value)
            for key, value in model.state_dict().items()
        }
    )
    for name, sh_ten in sharded.items():
        whole = (
            reference[name]
            if name in reference
            else torch.arange(torch.Size(sh_ten.global_shape).numel(), dtype=torch.float32).reshape(sh_ten.global_shape)
        )
        assert torch.equal(whole[sh_ten.global_slice()], sh_ten.data), name
        offsets[name] = (
            sh_ten.global_offset,
            sh_ten.local_shape,
            sh_ten.replica_id,
            sh_ten.axis_fragmentations,
            str(model[0].weight.placements),
        )
    dist_checkpointing.save(sharded, directory)
    loaded = dist_checkpointing.load_plain_tensors(directory)
    for name, (shape, _) in PLACEMENTS.items():
        assert torch.equal(loaded[name], torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape))
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
    return offsets


def test_any_placements_become_shards_that_tile_the_global_tensor(tmp_path):
    per_rank = run_distributed(convert_placements, 4, str(tmp_path))
    # rank 3 is (dp=1, tp=1)
    assert per_rank[3]["shard0_shard1"][:2] == ((3, 4), (3, 4))
    assert per_rank[3]["shard1_shard0"][:2] == ((3, 4), (3, 4))
    assert per_rank[3]["both_on_dim0"][:2] == ((6, 0), (2, 3))
    assert [r["replicate_shard1"][2] for r in per_rank] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    assert [r["shard0_replicate"][2] for r in per_rank] == [(0, 0), (0, 1), (0, 0), (0, 1)]
    assert [r["replicated"][2] for r in per_rank] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert [r["uneven"][:2] for r in per_rank] == [
        ((0, 0), (4, 3)),
        ((0, 3), (4, 2)),
        ((4, 0), (3, 3)),
        ((4, 3), (3, 2)),
    ]
    assert per_rank[0]["uneven"][3] is None and per_rank[0]["shard0_shard1"][3] == (2, 2)
    assert [r["empty_shards"][1] for r in per_rank] == [(1, 2), (1, 2), (1, 2), (0, 2)]
    # column-parallel weight [10, 6]: tp rank t holds rows 5t..5t+5, dp rank d then rows 3d.. of those
    assert "_StridedShard" in per_rank[0]["fsdp_tp.0.weight"][4]
    assert [r["fsdp_tp.0.weight"][:2] for r in per_rank] == [
        ((0, 0), (3, 6)),
        ((5, 0), (3, 6)),
        ((3, 0), (2, 6)),
        ((8, 0), (2, 6)),
    ]


def reject_partial(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    tensor = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with pytest.raises(ValueError, match="Partial placements") as partial_error:
        dtensor_to_sharded_tensor("partial", tensor)
    sub_mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))["tp"]
    with pytest.raises(ValueError, match="pass outer_replica_id"):
        dtensor_to_sharded_tensor("sub_mesh", distribute_tensor(torch.ones(4), sub_mesh, [Shard(0)]))
    sh_ten = dtensor_to_sharded_tensor(
        "sub_mesh", distribute_tensor(torch.ones(4), sub_mesh, [Shard(0)]), outer_replica_id=rank
    )
    assert sh_ten.replica_id == (rank,)
    whole_mesh = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    assert dtensor_to_sharded_tensor("whole_mesh", whole_mesh, outer_replica_id=rank).replica_id == (0, rank)
    return str(partial_error.value)


def test_partial_dtensor_and_sub_mesh_without_outer_replica_id_are_rejected():
    [message, _] = run_distributed(reject_partial, 2)
    assert message.startswith("partial: cannot checkpoint a DTensor with Partial placements")


LAYOUTS = {
    "tp2": dict(tensor_parallel=2, sequence_parallel=True, fsdp=False),
    "fsdp_dp2_tp2": dict(tensor_parallel=2, sequence_parallel=True, fsdp=True),
}
CONFIG = dict(num_query_groups=2)


def template(model, optimizer) -> dict:
    """What MegatronStrategy saves and loads into, without Lightning."""
    init_optimizer_state(optimizer)
    model_sharded = model_sharded_state_dict(model.state_dict(), replica_id=0)
    names = {param: name for name, param in model.named_parameters()}
    return {
        "model": model_sharded,
        "optimizer": optimizer_sharded_state_dict(named_optimizer_state(optimizer, names), model_sharded),
    }


def train_and_save(rank: int, world_size: int, layout: str, directory: str) -> dict[str, torch.Tensor]:
    config = gpt_config("tiny", **CONFIG)
    parallel = build_model(config, **LAYOUTS[layout])
    model = parallel.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train(parallel, optimizer, global_batches(config, steps=3))
    dist_checkpointing.save(template(model, optimizer), directory)
    return full_model_and_optimizer_state(model, optimizer)


def load_and_continue(rank: int, world_size: int, layout: str, directory: str) -> tuple[dict, list[float]]:
    config = gpt_config("tiny", **CONFIG)
    parallel = build_model(config, **LAYOUTS[layout])
    model = parallel.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loaded = dist_checkpointing.load(template(model, optimizer), directory)
    load_module_state(model, loaded["model"])
    load_named_optimizer_state(
        optimizer, {param: name for name, param in model.named_parameters()}, loaded["optimizer"]
    )
    state = full_model_and_optimizer_state(model, optimizer)
    return state, train(parallel, optimizer, global_batches(config, steps=2, first_step=3))


def train_uninterrupted(rank: int, world_size: int) -> list[float]:
    config = gpt_config("tiny", **CONFIG)
    parallel = build_model(config, 1, False, False)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=3e-3)
    return train(parallel, optimizer, global_batches(config, steps=5))[3:]


# TP=2 <-> FSDP DP=2 through MegatronStrategy: tests/tensor_parallel/test_strategy_tensor_parallel.py
@pytest.mark.parametrize("save_layout, save_ranks, load_layout, load_ranks", [("fsdp_dp2_tp2", 4, "tp2", 2)])
def test_checkpoint_reshards_across_tensor_parallel_sizes(tmp_path, save_layout, save_ranks, load_layout, load_ranks):
    saved = run_distributed(train_and_save, save_ranks, save_layout, str(tmp_path))[0]
    assert any(key.startswith("optimizer.exp_avg.") for key in saved)
    per_rank = run_distributed(load_and_continue, load_ranks, load_layout, str(tmp_path))
    expected_losses = train_uninterrupted(0, 1)
    for state, losses in per_rank:
        assert state.keys() == saved.keys()
        for key in saved:
            assert torch.equal(state[key], saved[key]), key
        assert losses == pytest.approx(expected_losses, rel=1e-5, abs=1e-5)
    stored = dist_checkpointing.load_plain_tensors(Path(tmp_path))
    assert stored["layers.0.self_attention.k_proj.weight"].shape == (32, 64)
    assert torch.equal(
        stored["optimizer.state.exp_avg.output_layer.weight"], saved["optimizer.exp_avg.output_layer.weight"]
    )

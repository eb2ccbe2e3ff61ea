from types import SimpleNamespace

import pytest
import torch.distributed as dist

from nemo_ckpt.parallel.mesh import ParallelDims, parallel_dims_of
from tests.helpers.distributed import run_distributed


def test_data_parallel_size_is_what_the_other_dimensions_leave():
    dims = ParallelDims(16, tp=2, pp=2, cp=2, ep=2)
    assert (dims.dp, dims.edp) == (2, 2)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"tp": 3}, "tensor_model_parallel_size=3 x pipeline_model_parallel_size=1 x context_parallel_size=1 = 3"),
        ({"pp": 0}, "pipeline_model_parallel_size=0 must be 1 or more"),
        ({"tp": 2, "ep": 3}, "expert_model_parallel_size=3 must divide data_parallel_size x context_parallel_size"),
    ],
)
def test_impossible_layouts_name_the_options(sizes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims(8, **sizes)


def _group_ranks(rank: int, world_size: int) -> dict[str, list[int]]:
    dims = ParallelDims(world_size, tp=2, cp=2, ep=2)
    mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    groups = {name: mesh[name].get_group() for name in ("tp", "cp", "dp")}
    groups["dp_cp"] = dims.data_context_parallel_mesh(mesh).get_group()
    groups |= {f"expert_{name}": expert_mesh[name].get_group() for name in ("ep", "edp")}
    return {name: dist.get_process_group_ranks(group) for name, group in groups.items()}


def test_rank_order_is_megatron_s_tp_cp_ep_dp_pp():
    rank0, rank1, rank2, rank3 = run_distributed(_group_ranks, 4)
    assert rank0 == {"tp": [0, 1], "cp": [0, 2], "dp": [0], "dp_cp": [0, 2], "expert_ep": [0, 2], "expert_edp": [0]}
    assert rank3["tp"] == [2, 3] and rank3["dp_cp"] == [1, 3] and rank3["expert_ep"] == [1, 3]
    assert rank1["cp"] == [1, 3] and rank2["tp"] == [2, 3]


def _layout(rank: int, world_size: int) -> dict:
    dims = ParallelDims(world_size, cp=2).build_meshes("cpu")
    return {
        "dp": (dims.dp_rank, dims.dp_mesh.size()),
        "cp": dist.get_process_group_ranks(dims.cp_mesh.get_group()),
        "dp_cp": dist.get_process_group_ranks(dims.dp_cp_mesh.get_group()),
        "expert_replicas": dist.get_process_group_ranks(dims.expert_replica_mesh.get_group()),
        "expert_mesh": dims.expert_mesh,
    }


def test_built_meshes_answer_ranks_and_groups_in_one_place():
    rank0, rank1 = run_distributed(_layout, 2)
    assert rank0 == {"dp": (0, 1), "cp": [0, 1], "dp_cp": [0, 1], "expert_replicas": [0, 1], "expert_mesh": None}
    assert rank1["dp"] == (0, 1)


def test_meshes_are_asked_for_after_they_are_built_and_other_strategies_are_data_parallel():
    with pytest.raises(RuntimeError, match=r"built by build_meshes\(\)"):
        ParallelDims(2, tp=2).tp_mesh.size()
    trainer = SimpleNamespace(strategy=object(), world_size=1)  # a Lightning strategy without parallel_dims
    dims = parallel_dims_of(trainer)
    assert (dims.dp, dims.dp_rank, dims.cp, dims.pp) == (1, 0, 1, 1)

"""Pipeline parallelism mechanics: the GPT's stage split, the options' errors, and the schedules' losses and
gradients against one process's autograd (2 gloo ranks, no Lightning)."""

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import init_device_mesh

from nemo_ckpt.models.gpt.model import GPT, gpt_config
from nemo_ckpt.models.gpt.pipeline import layers_per_rank, pack_targets, pipeline_loss, split_gpt, stage_layouts
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.gradients import GradientAllReducer
from nemo_ckpt.parallel.mesh import ParallelDims
from nemo_ckpt.parallel.pipeline import (
    PipelineConfig,
    PipelineRunner,
    StageGradientReducer,
    TiedWeight,
    embedding_group,
)
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.distributed import run_distributed


def test_stages_hold_consecutive_layers_in_interleaved_order():
    layouts = stage_layouts(gpt_config(num_layers=8), pipeline_size=2, virtual_size=2)
    assert [layout.layer_ids for layout in layouts] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [layout.pre_process for layout in layouts] == [True, False, False, False]
    assert [layout.post_process for layout in layouts] == [False, False, False, True]


def test_uneven_first_and_last_stages():
    config = gpt_config(num_layers=8, num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3)
    assert layers_per_rank(config, 4) == [1, 2, 2, 3]
    assert [layout.layer_ids for layout in stage_layouts(config, 4)] == [(0,), (1, 2), (3, 4), (5, 6, 7)]


@pytest.mark.parametrize(
    "overrides, pipeline_size, virtual_size, message",
    [
        ({"num_layers": 6}, 4, 1, r"num_layers=6 does not split over pipeline_model_parallel_size=4"),
        ({"num_layers": 6}, 2, 2, r"Pipeline rank 0 holds 3 layer\(s\).*virtual_pipeline_model_parallel_size=2"),
        (
            {"num_layers": 8, "num_layers_in_first_pipeline_stage": 3},
            3,
            1,
            r"num_layers=8 with num_layers_in_first_pipeline_stage=3 does not split",
        ),
        ({"num_layers_in_first_pipeline_stage": 1}, 1, 1, r"need pipeline_model_parallel_size > 1"),
    ],
)
def test_layer_split_errors_name_the_numbers(overrides, pipeline_size, virtual_size, message):
    with pytest.raises(ValueError, match=message):
        layers_per_rank(gpt_config(**overrides), pipeline_size, virtual_size)


def test_split_keeps_global_layer_keys():
    config = gpt_config(num_layers=4)
    keys = []
    for rank in range(2):
        model = GPT(config)
        stages = split_gpt(model, rank, 2, virtual_size=2)
        keys += list(model.state_dict())
        assert [stage.layers.indices() for _, stage in stages] == [[rank], [rank + 2]]
        assert all(param in set(model.parameters()) for _, stage in stages for param in stage.parameters())
    assert sorted(keys) == sorted(GPT(config).state_dict())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"virtual_pipeline_model_parallel_size": 2}, r"virtual_pipeline_model_parallel_size=2 needs pipeline_model"),
        ({"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb"}, r"pipeline schedule 'zb': choose one of"),
        (
            {"pipeline_model_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"},
            r"interleaved_1f1b schedule runs virtual stages",
        ),
        (
            {
                "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": 2,
                "microbatch_group_size_per_vp_stage": 4,
            },
            r"microbatch_group_size_per_vp_stage=4.*set it to 2",
        ),
        (
            {
                "pipeline_model_parallel_size": 2,
                "ddp": DistributedDataParallelConfig(data_parallel_sharding_strategy="optim"),
            },
            r"pipeline_model_parallel_size=2\) with data_parallel_sharding_strategy='optim'",
        ),
        ({"pipeline_model_parallel_size": 2, "pipeline_dtype": "int8"}, r"pipeline_dtype='int8'"),
    ],
)
def test_bad_pipeline_options_fail_at_configuration(options, message):
    with pytest.raises(ValueError, match=message):
        MegatronStrategy(**options)


def test_micro_batch_counts_follow_the_schedules_rules():
    with pytest.raises(
        ValueError, match=r"1f1b pipeline schedule needs at least pipeline_model_parallel_size=4 .* = 2"
    ):
        PipelineConfig(4).validate_microbatches(2)
    with pytest.raises(ValueError, match=r"= 6 micro-batches to be a multiple of .*pipeline_model_parallel_size=4"):
        PipelineConfig(4, 2).validate_microbatches(6)
    PipelineConfig(4, 2).validate_microbatches(8)
    PipelineConfig(4, schedule="gpipe").validate_microbatches(1)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 .* must divide the world size 3"):
        ParallelDims(3, pp=2)


CASES = [
    ("gpipe", 1, {}, {}),
    ("1f1b", 1, {}, {}),
    ("1f1b", 1, {}, {"batch_p2p_comm": False}),
    ("interleaved_1f1b", 2, {}, {}),
    ("interleaved_1f1b", 2, {}, {"overlap_p2p_comm": False}),
    ("1f1b", 1, {"share_embeddings_and_output_weights": True}, {}),
    ("1f1b", 1, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3}, {}),
]
P2P_FUNCTIONS = ("isend", "irecv", "batch_isend_irecv")


@contextmanager
def counted_p2p_calls() -> Iterator[Counter]:
    """Count calls of torch.distributed's isend, irecv and batch_isend_irecv (the real functions still run;
    replaced in both namespaces, since batch_isend_irecv compares `op is isend` in distributed_c10d)."""
    calls: Counter = Counter()
    real = {name: getattr(distributed_c10d, name) for name in P2P_FUNCTIONS}

    def spy(name: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real[name](*args, **kwargs)

        return call

    spies = {name: spy(name) for name in P2P_FUNCTIONS}
    for module in (torch.distributed, distributed_c10d):
        for name, function in spies.items():
            setattr(module, name, function)
    try:
        yield calls
    finally:
        for module in (torch.distributed, distributed_c10d):
            for name, function in real.items():
                setattr(module, name, function)


def receive_leads(schedule: Any, rank: int) -> list[int]:
    """For each receive in `rank`'s action list of a runtime schedule, how many forwards and backwards run
    between posting it and the computation that uses it (0: posted just before its use, nothing to overlap)."""
    actions = [action for action in schedule.pipeline_order_with_comms[rank] if action is not None]
    leads = []
    for position, action in enumerate(actions):
        if action.computation_type in ("RECV_F", "RECV_B"):
            use = "F" if action.computation_type == "RECV_F" else "B"
            later = actions[position + 1 :]
            end = next(
                index
                for index, other in enumerate(later)
                if other.computation_type == use
                and (other.stage_index, other.microbatch_index) == (action.stage_index, action.microbatch_index)
            )
            leads.append(sum(other.computation_type in ("F", "B") for other in later[:end]))
    return leads


def schedules_match_autograd(rank: int, world_size: int) -> list[tuple[str, dict, list[int] | None]]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(256, (4, 32), generator=generator)
    targets = pack_targets(torch.randint(256, (4, 32), generator=generator), None)
    checked = []
    for schedule, virtual_size, overrides, p2p in CASES:
        config = gpt_config(num_layers=4, **overrides)
        torch.manual_seed(0)
        reference = GPT(config)
        expected_loss = sum(pipeline_loss(reference(tokens[i : i + 1]), targets[i : i + 1]) for i in range(4)) / 4
        expected_loss.backward()
        expected = {name: param.grad for name, param in reference.named_parameters()}

        torch.manual_seed(0)
        model = GPT(config)
        stages = split_gpt(model, rank, world_size, virtual_size)
        config_pp = PipelineConfig(world_size, virtual_size if virtual_size > 1 else None, schedule=schedule, **p2p)
        runner = PipelineRunner(config_pp, stages, mesh, torch.device("cpu"), 4, pipeline_loss)
        runner.run(tokens, targets, train=True)  # the first step also sends the stages' shapes
        model.zero_grad(set_to_none=True)
        with counted_p2p_calls() as calls:
            loss = runner.run(tokens, targets, train=True)
        if config.share_embeddings_and_output_weights:
            group, is_first = embedding_group(mesh, "pp")
            TiedWeight(model, "embedding.weight", group, is_first).all_reduce_grad()
        torch.testing.assert_close(loss, expected_loss.detach(), rtol=0, atol=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7, msg=f"{schedule} {name}")
        leads = receive_leads(runner.schedule, rank) if hasattr(runner.schedule, "pipeline_order_with_comms") else None
        checked.append((f"{schedule}{overrides}{p2p}", dict(calls), leads))
    return checked


@pytest.fixture(scope="module")
def schedule_runs() -> list[list[tuple[str, dict, list[int] | None]]]:
    return run_distributed(schedules_match_autograd, 2)


def test_schedules_give_one_process_loss_and_gradients(schedule_runs):
    checked = schedule_runs
    assert [name for name, _, _ in checked[0]] == [name for name, _, _ in checked[1]]
    assert len(checked[0]) == len(CASES)


def test_p2p_options_change_how_sends_and_receives_are_posted(schedule_runs):
    """batch_p2p_comm: 1f1b's steady-state send and receive go out in one batch_isend_irecv, or each on its own
    (same number of sends and receives); overlap_p2p_comm: the interleaved schedule's receives are posted ahead
    of other computations, or each just before its use. Losses and gradients are the one-process ones for all
    (test above)."""
    for rank, checked in enumerate(schedule_runs):
        runs = {name: (calls, leads) for name, calls, leads in checked}
        batched, _ = runs["1f1b{}{}"]
        unbatched, leads = runs["1f1b{}{'batch_p2p_comm': False}"]
        assert batched["batch_isend_irecv"] == 4 - 1  # the steady state's send-and-receive pairs
        assert unbatched.get("batch_isend_irecv", 0) == 0
        sends_and_receives = 2 * 4  # each rank sends and receives one tensor per micro-batch
        assert batched["isend"] + batched["irecv"] == unbatched["isend"] + unbatched["irecv"] == sends_and_receives
        assert leads == [0] * 4  # every receive posted right before its use
        _, overlapped = runs["interleaved_1f1b{}{}"]
        _, deferred = runs["interleaved_1f1b{}{'overlap_p2p_comm': False}"]
        assert len(overlapped) == len(deferred) > 0
        assert max(overlapped) > 0, f"rank {rank}: no receive posted ahead: {overlapped}"
        assert deferred == [0] * len(deferred)


def stage_buckets_run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(256, (8, 32), generator=generator)
    targets = pack_targets(torch.randint(256, (8, 32), generator=generator), None)
    config = gpt_config(num_layers=4)
    torch.manual_seed(0)
    reference = GPT(config)
    (sum(pipeline_loss(reference(tokens[i : i + 1]), targets[i : i + 1]) for i in range(8)) / 8).backward()
    mine = slice(4 * dp_rank, 4 * dp_rank + 4)
    grads, seen_during_backward, launch_order = {}, [], None
    for overlap in (False, True):
        torch.manual_seed(0)
        model = GPT(config)
        stages = split_gpt(model, pp_rank, 2, 2)
        runner = PipelineRunner(PipelineConfig(2, 2), stages, mesh["pp"], torch.device("cpu"), 4, pipeline_loss)
        group = mesh["dp"].get_group()
        reducer = StageGradientReducer(stages, group, 4) if overlap else GradientAllReducer(model, group, False)
        if isinstance(reducer, StageGradientReducer):  # what had started while the first stage was in backward

            def snapshot(_: torch.Tensor, launched: list[int] = reducer.launched) -> None:
                seen_during_backward.append(list(launched))

            for param in stages[0][1].parameters():
                param.register_post_accumulate_grad_hook(snapshot)
        runner.run(tokens[mine], targets[mine], train=True)
        launch_order = reducer.finish() or launch_order
        grads[overlap] = {name: param.grad for name, param in model.named_parameters()}
    for name, param in reference.named_parameters():
        if name in grads[True]:
            torch.testing.assert_close(grads[True][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
            assert torch.equal(grads[True][name], grads[False][name]), name
    return {"stages": [index for index, _ in stages], "launched": launch_order, "seen": seen_during_backward}


def test_gradients_reduce_per_virtual_stage_while_other_stages_compute():
    """overlap_grad_reduce under PP=2 x DP=2 with V=2: each virtual stage's gradients are one bucket, started as
    soon as its last micro-batch's backward is done, while the rank's earlier stage is still in backward; the
    averaged gradients equal one process's and the reduce-all-after-the-schedule path bit for bit."""
    for result in run_distributed(stage_buckets_run, 4):
        first, second = result["stages"]
        assert result["launched"] == [second, first]
        assert [second] in result["seen"]

"""Pipeline parallelism mechanics: the GPT's stage split, the options' errors, and the schedules' losses and
gradients against one process's autograd (2 gloo ranks, no Lightning)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from nemo_ckpt.models.gpt.model import GPT, gpt_config
from nemo_ckpt.models.gpt.pipeline import layers_per_rank, pack_targets, pipeline_loss, split_gpt, stage_layouts
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.mesh import ParallelDims
from nemo_ckpt.parallel.pipeline import PipelineConfig, PipelineRunner, TiedWeight, embedding_group
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
    ("gpipe", 1, {}),
    ("1f1b", 1, {}),
    ("interleaved_1f1b", 2, {}),
    ("1f1b", 1, {"share_embeddings_and_output_weights": True}),
    ("1f1b", 1, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3}),
]


def schedules_match_autograd(rank: int, world_size: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(256, (4, 32), generator=generator)
    targets = pack_targets(torch.randint(256, (4, 32), generator=generator), None)
    checked = []
    for schedule, virtual_size, overrides in CASES:
        config = gpt_config(num_layers=4, **overrides)
        torch.manual_seed(0)
        reference = GPT(config)
        expected_loss = sum(pipeline_loss(reference(tokens[i : i + 1]), targets[i : i + 1]) for i in range(4)) / 4
        expected_loss.backward()
        expected = {name: param.grad for name, param in reference.named_parameters()}

        torch.manual_seed(0)
        model = GPT(config)
        stages = split_gpt(model, rank, world_size, virtual_size)
        config_pp = PipelineConfig(world_size, virtual_size if virtual_size > 1 else None, schedule=schedule)
        runner = PipelineRunner(config_pp, stages, mesh, torch.device("cpu"), 4, pipeline_loss)
        loss = runner.run(tokens, targets, train=True)
        if config.share_embeddings_and_output_weights:
            group, is_first = embedding_group(mesh, "pp")
            TiedWeight(model, "embedding.weight", group, is_first).all_reduce_grad()
        torch.testing.assert_close(loss, expected_loss.detach(), rtol=0, atol=1e-6)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-5, atol=1e-7, msg=f"{schedule} {name}")
        checked.append(f"{schedule}{overrides}")
    return checked


def test_schedules_give_one_process_loss_and_gradients():
    checked = run_distributed(schedules_match_autograd, 2)
    assert checked[0] == checked[1] and len(checked[0]) == len(CASES)

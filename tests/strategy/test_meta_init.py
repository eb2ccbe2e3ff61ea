"""`init_model_with_meta_device`: the model is built on `meta` and materialized unit by unit while it is sharded,
with the same weights as an eagerly built model."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from nemo_ckpt.models.gpt import GPT, gpt_config
from nemo_ckpt.parallel.ddp_config import SHARDING_STRATEGIES, DistributedDataParallelConfig
from nemo_ckpt.parallel.fsdp import apply_fsdp
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import fit


def shard_meta_model(rank: int, world_size: int) -> dict[str, object]:
    config = gpt_config("tiny", ffn_hidden_size=170)
    torch.manual_seed(7)
    eager = GPT(config)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = GPT(config)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    apply_fsdp(
        [model],
        mesh,
        DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params"),
        torch.device("cpu"),
    )
    params = dict(model.named_parameters())
    return {
        "all_dtensors_on_cpu": all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params.values()),
        "equal_to_eager": all(torch.equal(params[name].full_tensor(), p) for name, p in eager.named_parameters()),
        "local_elements": sum(p.to_local().numel() for p in params.values()),
        "total_elements": config.num_parameters(),
    }


def train_meta_and_eager(rank: int, world_size: int) -> dict[str, tuple[list[float], list[float]]]:
    return {
        strategy: (
            fit(world_size, {"data_parallel_sharding_strategy": strategy}, 3),
            fit(world_size, {"data_parallel_sharding_strategy": strategy}, 3, init_model_with_meta_device=True),
        )
        for strategy in SHARDING_STRATEGIES
    }


def test_meta_model_is_materialized_shard_by_shard_with_eager_weights():
    for result in run_distributed(shard_meta_model, 2):
        assert result["all_dtensors_on_cpu"] and result["equal_to_eager"]
        assert abs(result["local_elements"] - result["total_elements"] / 2) <= 64, "each rank holds half the model"


def test_meta_init_trains_exactly_like_eager_init_for_every_strategy():
    [results] = run_distributed(train_meta_and_eager, 2)[:1]
    for strategy, (eager, meta) in results.items():
        assert meta == eager, strategy

"""`DistributedDataParallelConfig` and `MegatronStrategy(ddp=...)`: valid settings build, invalid ones fail at
configuration time with one message naming the option."""

import fiddle as fdl
import nemo_run as run
import pytest

from nemo_ckpt.models.gpt import TransformerLayer
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from recipes import gpt


def test_recipe_style_config_builds_the_strategy():
    config = run.Config(
        MegatronStrategy,
        ddp=run.Config(
            DistributedDataParallelConfig,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_param_gather=True,
            grad_reduce_in_fp32=True,
            fsdp_unit_modules=["nemo_ckpt.models.gpt.TransformerLayer"],
        ),
    )
    strategy = fdl.build(config)
    assert strategy.ddp_config.data_parallel_sharding_strategy == "optim_grads_params"
    assert strategy.ddp_config.shards_parameters
    assert strategy.ddp_config.fsdp_unit_module_classes() == (TransformerLayer,)


def test_nemo_string_shortcuts():
    assert MegatronStrategy(ddp="megatron").ddp_config == DistributedDataParallelConfig(check_for_nan_in_grad=True)
    assert MegatronStrategy(ddp="pytorch").ddp_config == DistributedDataParallelConfig()
    with pytest.raises(ValueError, match=r"MegatronStrategy\(ddp='apex'\): use 'megatron', 'pytorch'"):
        MegatronStrategy(ddp="apex")


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"data_parallel_sharding_strategy": "full_shard"},
            r"data_parallel_sharding_strategy='full_shard' is unknown; choose one of \['no_shard', 'optim'",
        ),
        ({"overlap_param_gather": True}, r"overlap_param_gather=True needs sharded parameters or optimizer state"),
        ({"bucket_size": 0}, r"bucket_size=0 must be a positive number of elements"),
        (
            {"fsdp_unit_modules": ["nemo_ckpt.models.gpt.Block"]},
            r"fsdp_unit_modules entry 'nemo_ckpt.models.gpt.Block'",
        ),
        ({"fsdp_unit_modules": ["nemo_ckpt.models.gpt.GPTConfig"]}, r"is not an importable torch.nn.Module class"),
    ],
)
def test_invalid_combinations_fail_at_configuration(options, message):
    with pytest.raises(ValueError, match=message):
        DistributedDataParallelConfig(**options)
    with pytest.raises(ValueError, match=message):
        fdl.build(run.Config(MegatronStrategy, ddp=run.Config(DistributedDataParallelConfig, **options)))


def test_ddp_bucket_cap_follows_bucket_size_and_overlap():
    overlapped = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2**20)
    assert overlapped.ddp_bucket_cap_mb(data_parallel_size=2, element_size=4, total_elements=10**9) == 4.0
    megatron_default = DistributedDataParallelConfig(overlap_grad_reduce=True)
    assert megatron_default.ddp_bucket_cap_mb(64, 4, 10**9) == 64_000_000 * 4 / 2**20
    one_bucket = DistributedDataParallelConfig(overlap_grad_reduce=False)
    assert one_bucket.ddp_bucket_cap_mb(2, 4, 3 * 2**20) > 12.0
    with pytest.raises(ValueError, match=r"set ddp.bucket_size \(elements\) instead"):
        MegatronStrategy(bucket_cap_mb=25)


def test_recipes_configure_data_parallelism():
    tiny = gpt.tiny()
    assert tiny.trainer.strategy.ddp.data_parallel_sharding_strategy == "no_shard"
    tiny.trainer.strategy.ddp.data_parallel_sharding_strategy = "optim_grads_params"
    tiny.trainer.strategy.ddp.overlap_param_gather = True
    assert fdl.build(tiny.trainer.strategy).ddp_config.shards_parameters
    large = gpt.llama3_8b()
    assert large.trainer.strategy.ddp.data_parallel_sharding_strategy == "optim_grads_params"
    assert large.trainer.strategy.init_model_with_meta_device and large.trainer.precision == "bf16-mixed"


def test_misspelt_and_megatron_only_options_are_named():
    with pytest.raises(TypeError, match=r"unknown option `bucket_sz`; did you mean `bucket_size`\?"):
        DistributedDataParallelConfig(bucket_sz=10)
    with pytest.raises(ValueError, match=r"not supported: use_distributed_optimizer \(NeMo meaning: .*'optim'"):
        DistributedDataParallelConfig(use_distributed_optimizer=True)
    with pytest.raises(AttributeError, match="bucket_sz"):
        run.Config(DistributedDataParallelConfig).bucket_sz = 10

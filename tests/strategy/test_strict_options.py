"""`MegatronStrategy` takes only its declared arguments: a typo names the closest option, a NeMo option not
implemented says what it means, from Python, from a Fiddle config (at configuration) and from the `nemo` CLI."""

import fiddle as fdl
import nemo_run as run
import pytest

from nemo_ckpt._compat import lightning_ddp_kwargs
from nemo_ckpt.options import UnknownOptionError, UnsupportedOptionError
from nemo_ckpt.parallel import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers import commands


def test_typo_is_refused_with_the_closest_option():
    with pytest.raises(UnknownOptionError, match=r"unknown option `ckpt_async_sav`; did you mean `ckpt_async_save`\?"):
        MegatronStrategy(ckpt_async_sav=True)
    with pytest.raises(TypeError, match="ckpt_async_sav"):  # Fiddle checks the name when the config is made
        run.Config(MegatronStrategy, ckpt_async_sav=True)
    config = run.Config(MegatronStrategy)
    with pytest.raises(AttributeError, match="ckpt_async_sav"):
        config.ckpt_async_sav = True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ckpt_load_on_device": True}, r"not supported: ckpt_load_on_device \(NeMo meaning: .*GPU"),
        ({"pipeline_model_parallel_comm_backend": "nccl"}, r"not supported: pipeline_model_parallel_comm_backend"),
        ({"fsdp": "pytorch"}, r"not supported: fsdp .*optim_grads_params"),
        ({"ddp_comm_hook": print}, r"not supported: ddp_comm_hook"),
    ],
)
def test_nemo_options_not_implemented_say_what_they_mean(options, message):
    with pytest.raises(UnsupportedOptionError, match=message):
        MegatronStrategy(**options)


def test_nemo_defaults_and_ddp_options_are_accepted_where_they_apply():
    strategy = MegatronStrategy(pipeline_model_parallel_size=1, context_parallel_size=1, find_unused_parameters=True)
    assert lightning_ddp_kwargs(strategy)["find_unused_parameters"] is True
    assert strategy._timeout.total_seconds() == 1800
    fsdp = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    with pytest.raises(ValueError, match=r"find_unused_parameters=True\) is an option of torch DDP"):
        MegatronStrategy(ddp=fsdp, find_unused_parameters=True)
    with pytest.raises(ValueError, match="static_graph"):
        fdl.build(run.Config(MegatronStrategy, tensor_model_parallel_size=2, static_graph=True))


def test_cli_override_with_a_typo_fails_at_dryrun_naming_the_option(tmp_path):
    args = ["nemo_ckpt", "pretrain", "--factory", "tiny", "--dryrun"]
    typo = commands.nemo(*args, "trainer.strategy.ckpt_async_sav=True", cwd=tmp_path)
    assert typo.returncode != 0
    assert "unknown option `ckpt_async_sav`; did you mean `ckpt_async_save`?" in typo.stdout
    executor_typo = commands.nemo(*args, "run.executor=local", "run.executor.ntasks_per_nod=2", cwd=tmp_path)
    assert executor_typo.returncode != 0
    expected = "local_executor: unknown option `ntasks_per_nod`; did you mean `ntasks_per_node`?"
    assert expected in executor_typo.stdout

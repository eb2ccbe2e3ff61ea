"""Communication-overlap options: TP ones accepted with NeMo's names, GPU-only ones rejected on CPU; pipeline
send/receive ones set on the strategy's pipeline or rejected where they cannot take effect."""

from types import SimpleNamespace

import pytest
import torch

from nemo_ckpt.strategy import MegatronStrategy
from nemo_ckpt.strategy.comm_overlap import (
    BulkOverlapCfg,
    MegatronCommOverlapCallback,
    RingExchangeOverlapCfg,
    TPCommOverlapConfig,
    TransformerLayerTPOverlapCfg,
)


def test_defaults_are_valid_on_cpu_for_any_layout():
    config = TPCommOverlapConfig()
    for tensor_parallel, sequence_parallel in [(1, False), (2, False), (2, True)]:
        config.validate("cpu", tensor_parallel, sequence_parallel)
    assert not config.overlaps_all_gather_and_reduce_scatter


@pytest.mark.parametrize(
    "option",
    ["tp_comm_overlap", "tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad"],
)
def test_gpu_only_overlap_is_rejected_on_cpu(option):
    config = TPCommOverlapConfig(**{option: True})
    with pytest.raises(
        ValueError,
        match=f"{option}=True: tensor-parallel communication overlap needs GPU-only "
        "kernels .* this run is on 'cpu'; leave these options unset",
    ):
        config.validate("cpu", 2, True)


def test_async_tensor_parallel_on_cuda_with_sequence_parallel():
    config = TPCommOverlapConfig(tp_comm_overlap=True, tp_comm_bootstrap_backend="gloo")
    config.validate("cuda", 2, True)
    assert config.overlaps_all_gather_and_reduce_scatter
    both_off = TPCommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_ag=False, tp_comm_overlap_rs=False)
    both_off.validate("cuda", 2, True)
    assert not both_off.overlaps_all_gather_and_reduce_scatter


@pytest.mark.parametrize(
    "options, tensor_parallel, sequence_parallel, message",
    [
        ({"tp_comm_overlap": True}, 1, False, r"needs tensor_model_parallel_size > 1 \(got 1\)"),
        ({"tp_comm_overlap": True}, 2, False, r"and sequence_parallel=True \(got False\)"),
        ({"tp_comm_overlap": True, "tp_comm_overlap_ag": False}, 2, True, "set both alike"),
        ({"tp_comm_overlap_rs": True}, 2, True, "takes effect only with tp_comm_overlap=True"),
        (
            {"tp_comm_overlap": True, "tp_comm_bulk_wgrad": True},
            2,
            True,
            "tp_comm_bulk_wgrad=True: bulk TP overlap exists only in Transformer Engine userbuffers",
        ),
        (
            {
                "tp_comm_overlap": True,
                "tp_comm_overlap_cfg": TransformerLayerTPOverlapCfg(
                    qkv_dgrad=BulkOverlapCfg(num_sm=4, cga_size=2, set_sm_margin=False),
                    qkv_fprop=RingExchangeOverlapCfg(aggregate=False),
                ),
            },
            2,
            True,
            "tp_comm_overlap_cfg tunes Transformer Engine userbuffers",
        ),
    ],
)
def test_overlap_that_cannot_be_provided_on_cuda_is_rejected(options, tensor_parallel, sequence_parallel, message):
    with pytest.raises(ValueError, match=message):
        TPCommOverlapConfig(**options).validate("cuda", tensor_parallel, sequence_parallel)


def test_unknown_bootstrap_backend_is_rejected():
    with pytest.raises(ValueError, match=r"tp_comm_bootstrap_backend='ucx' is unknown; choose one of"):
        TPCommOverlapConfig(tp_comm_bootstrap_backend="ucx")


def set_up(callback: MegatronCommOverlapCallback, **strategy_options: int) -> MegatronStrategy:
    strategy = MegatronStrategy(**strategy_options)
    strategy.parallel_devices = [torch.device("cpu")]
    callback.setup(SimpleNamespace(strategy=strategy), None, "fit")
    return strategy


def test_p2p_options_reach_the_strategy_s_pipeline():
    strategy = set_up(
        MegatronCommOverlapCallback(overlap_p2p_comm=False),
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    )
    assert not strategy.pipeline_config.overlaps_p2p and not strategy.pipeline_config.batches_p2p
    strategy = set_up(MegatronCommOverlapCallback(batch_p2p_comm=False), pipeline_model_parallel_size=2)
    assert strategy.pipeline_config.schedule_name == "1f1b" and not strategy.pipeline_config.batches_p2p
    defaults = set_up(MegatronCommOverlapCallback(), pipeline_model_parallel_size=2).pipeline_config
    assert defaults.batches_p2p and not defaults.overlaps_p2p


@pytest.mark.parametrize(
    "callback_options, strategy_options, message",
    [
        ({"batch_p2p_comm": True}, {}, r"batch_p2p_comm=True: pipeline send/receive options need pipeline_model"),
        ({"overlap_p2p_comm": True}, {"pipeline_model_parallel_size": 2}, r"interleaved schedule only \(the '1f1b'"),
        (
            {"batch_p2p_comm": True},
            {"pipeline_model_parallel_size": 2, "pipeline_schedule": "gpipe"},
            r"1f1b schedule only \(gpipe never sends and receives in the same step\)",
        ),
        (
            {"batch_p2p_comm": True},
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            r"1f1b schedule only \(torch's interleaved runtime posts each send and receive on its own\)",
        ),
        (
            {"batch_p2p_comm": True, "overlap_p2p_comm": True},
            {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            r"cannot be batched \(Megatron's rule\); set batch_p2p_comm=False",
        ),
    ],
)
def test_p2p_options_that_cannot_take_effect_are_rejected(callback_options, strategy_options, message):
    with pytest.raises(ValueError, match=message):
        set_up(MegatronCommOverlapCallback(**callback_options), **strategy_options)

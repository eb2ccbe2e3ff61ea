"""Tensor (and sequence) parallel training follows single-process training step for step."""

import pytest
import torch

from nemo_ckpt.models.gpt import gpt_config
from nemo_ckpt.models.gpt.parallelize import validate_tensor_parallel
from tests.helpers.distributed import run_distributed
from tests.helpers.tensor_parallel import build_model, global_batches, train

STEPS = 10


def train_losses(
    rank: int, world_size: int, config_overrides: dict, tensor_parallel: int, sequence_parallel: bool, fsdp: bool
) -> list[float]:
    config = gpt_config("tiny", **config_overrides)
    parallel = build_model(config, tensor_parallel, sequence_parallel, fsdp)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=3e-3, weight_decay=0.01)
    return train(parallel, optimizer, global_batches(config, STEPS))


@pytest.mark.parametrize(
    "world_size, tensor_parallel, sequence_parallel, fsdp, config_overrides",
    [
        pytest.param(2, 2, False, False, {"share_embeddings_and_output_weights": True}, id="tp2-tied-embeddings"),
        pytest.param(2, 2, True, False, {}, id="tp2-sp"),
        pytest.param(4, 2, True, False, {"num_query_groups": 2}, id="dp2-tp2-sp-gqa"),
    ],
)
def test_tensor_parallel_matches_single_process(world_size, tensor_parallel, sequence_parallel, fsdp, config_overrides):
    reference = train_losses(0, 1, config_overrides, 1, False, False)
    assert reference[-1] < reference[0] - 0.5, "the tiny model learns"
    per_rank = run_distributed(train_losses, world_size, config_overrides, tensor_parallel, sequence_parallel, fsdp)
    for losses in per_rank:
        assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(
    "overrides, tensor_parallel, sequence_parallel, message",
    [
        (
            {"num_query_groups": 1},
            2,
            False,
            "GPTConfig.num_query_groups=1 is not divisible by tensor_model_parallel_size=2",
        ),
        ({"num_attention_heads": 2, "num_query_groups": 2}, 4, False, "GPTConfig.num_attention_heads=2"),
        ({"vocab_size": 255}, 2, False, "GPTConfig.vocab_size=255"),
        ({"seq_length": 31}, 2, True, "GPTConfig.seq_length=31"),
        ({}, 1, True, "sequence_parallel=True needs tensor_model_parallel_size > 1"),
        ({}, 0, False, "tensor_model_parallel_size=0 must be >= 1"),
    ],
)
def test_config_that_cannot_be_split_is_rejected(overrides, tensor_parallel, sequence_parallel, message):
    with pytest.raises(ValueError, match=message):
        validate_tensor_parallel(gpt_config("tiny", **overrides), tensor_parallel, sequence_parallel)


def test_seq_length_need_not_divide_without_sequence_parallel():
    validate_tensor_parallel(gpt_config("tiny", seq_length=31), 2, sequence_parallel=False)

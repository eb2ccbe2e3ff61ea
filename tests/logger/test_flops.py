"""Model FLOPs of the GPT: a hand count of the tiny config, and torch's own FLOP counter on the real model."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nemo_ckpt.logger.flops import peak_flops_per_device, training_flops_per_step, training_flops_per_token
from nemo_ckpt.models.gpt.model import GPT, gpt_config


def test_tiny_config_flops_match_a_hand_count():
    config = gpt_config("tiny")  # 2 layers, hidden 64, 4 heads (no GQA), FFN 172, vocabulary 256, sequence 32
    assert (config.num_layers, config.hidden_size, config.num_query_groups) == (2, 64, 4)
    assert (config.ffn_hidden_size, config.vocab_size, config.seq_length) == (172, 256, 32)
    q_k_v_o = 4 * 64 * 64  # 16384 weights
    mlp = 3 * 64 * 172  # 33024: gate, up, down
    output_layer = 64 * 256  # 16384
    weights = 2 * (q_k_v_o + mlp) + output_layer  # 115200
    attention = 2 * (2 * 32 * 64 + 2 * 32 * 64)  # Q K^T and softmax @ V over 32 positions, 2 layers: 16384
    forward_per_token = 2 * weights + attention  # 246784
    assert training_flops_per_token(config) == 3 * forward_per_token == 740352
    assert training_flops_per_step(config, global_batch_size=8) == 740352 * 8 * 32 == 189530112


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_query_groups": 2, "share_embeddings_and_output_weights": True}, {"num_layers": 3, "seq_length": 48}],
    ids=["tiny", "gqa_tied", "deeper_longer"],
)
def test_flops_equal_torch_flop_counter_on_a_forward_and_backward(overrides):
    config = gpt_config("tiny", **overrides)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (3, config.seq_length))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # attention as countable matmuls
        model(tokens).float().sum().backward()
    assert counter.get_total_flops() == training_flops_per_step(config, global_batch_size=3)


def test_no_peak_on_cpu():
    assert peak_flops_per_device(torch.device("cpu"), "bf16-mixed") is None
    assert peak_flops_per_device(torch.device("cpu"), "32-true") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_peak_of_a_known_gpu():  # pragma: no cover - GPU only
    name = torch.cuda.get_device_name().lower()
    peak = peak_flops_per_device(torch.device("cuda"), "bf16-mixed")
    if "h100" in name and "pcie" not in name or "h200" in name:
        assert peak == 989e12
    elif "a100" in name:
        assert peak == 312e12

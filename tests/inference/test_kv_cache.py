"""The KV cache: decode steps over it give the logits of recomputing the whole sequence, with and without left
padding, and the training path (no cache) is unchanged."""

import pytest
import torch

from nemo_ckpt.models.gpt.kv_cache import KVCache
from nemo_ckpt.models.gpt.model import GPT, gpt_config


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", num_query_groups=2, **overrides)).eval()


@torch.no_grad()
def test_decode_steps_equal_full_recompute():
    model = tiny_gpt(qk_layernorm=True)
    tokens = torch.randint(256, (2, 12))
    full = model(tokens)
    cache = KVCache(max_length=12)
    steps = [model(tokens[:, :5], torch.arange(5), kv_cache=cache)]  # prefill, then a chunk, then single tokens
    steps.append(model(tokens[:, 5:8], torch.arange(5, 8), kv_cache=cache))
    steps += [model(tokens[:, i : i + 1], torch.tensor([i]), kv_cache=cache) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 12


@torch.no_grad()
def test_left_padding_is_invisible():
    model = tiny_gpt()
    tokens = torch.randint(256, (1, 6))
    alone = model(tokens)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], dim=1)
    padding = torch.arange(10) >= 3
    cache = KVCache(max_length=10, padding=padding.unsqueeze(0))
    positions = (torch.arange(9) - 3).clamp(min=0).unsqueeze(0)
    prefill = model(padded, positions, kv_cache=cache)[:, 3:]
    torch.testing.assert_close(prefill, alone, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(model(tokens[:, :1], torch.tensor([[6]]), kv_cache=cache)).all()


def test_cache_refuses_positions_beyond_its_length():
    model = tiny_gpt()
    cache = KVCache(max_length=4)
    with pytest.raises(ValueError, match=r"KVCache\(max_length=4\) cannot hold 5 positions"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)

import pytest
import torch

from nemo_ckpt.models.gpt import GPT, PRESETS, gpt_config


@pytest.mark.parametrize("overrides", [{}, {"num_query_groups": 2, "share_embeddings_and_output_weights": True}])
def test_parameter_count_matches_config(overrides):
    config = gpt_config("tiny", **overrides)
    model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_presets_span_tiny_to_8b():
    assert PRESETS["tiny"].num_parameters() < 200_000
    assert 8.0e9 < PRESETS["llama3_8b"].num_parameters() < 8.1e9


def test_forward_shape_and_causality():
    torch.manual_seed(0)
    config = gpt_config("tiny")
    model = GPT(config)
    tokens = torch.randint(config.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, config.vocab_size)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
    assert torch.equal(model(changed)[:, :-1], logits[:, :-1])


def test_bad_config_names_the_fields():
    with pytest.raises(ValueError, match="hidden_size=65 must be divisible by num_attention_heads=4"):
        gpt_config("tiny", hidden_size=65)
    with pytest.raises(ValueError, match="Unknown model size 'huge'"):
        gpt_config("huge")

"""`generate_tokens`: greedy tokens equal to transformers' `generate` for every Hugging Face family the converters
take; prompts of different lengths batched as each alone; seeded sampling repeats; stop tokens; named errors."""

import pytest
import torch

from nemo_ckpt.checkpoint.context import load_model
from nemo_ckpt.inference.generate import generate_tokens
from nemo_ckpt.inference.sampling import SamplingParams
from nemo_ckpt.models.gpt.model import GPT, gpt_config

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16, 17, 18, 19, 20], [30]]


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", num_query_groups=2, **overrides)).eval()


@pytest.mark.parametrize("family", ["llama", "llama3.1", "mistral", "qwen2", "qwen3", "mixtral"])
def test_greedy_tokens_equal_transformers(tmp_path, family):
    transformers = pytest.importorskip("transformers")
    from nemo_ckpt.models.gpt.convert import import_hf
    from tests.models.test_hf import make_hf_llama
    from tests.models.test_hf_families import make_hf_model

    source = make_hf_llama(tmp_path / "hf") if family == "llama" else make_hf_model(tmp_path / "hf", family)
    model = load_model(import_hf(source, tmp_path / "ours"))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(source)
    prompts = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    expected = hf_model.generate(prompts, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate_tokens(model, prompts.tolist(), SamplingParams(max_new_tokens=24)) == expected[:, 7:].tolist()


def test_batched_rows_equal_each_prompt_alone():
    model = tiny_gpt(qk_layernorm=True)
    for params in (SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, top_k=1)):
        alone = [generate_tokens(model, [prompt], params)[0] for prompt in PROMPTS]
        assert generate_tokens(model, PROMPTS, params) == alone


def test_seeded_sampling_repeats_and_top_k_1_is_greedy():
    model = tiny_gpt()
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=7)
    first = generate_tokens(model, PROMPTS, sampled)
    assert generate_tokens(model, PROMPTS, sampled) == first
    assert generate_tokens(model, PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, seed=8)) != first
    greedy = generate_tokens(model, PROMPTS, SamplingParams(max_new_tokens=16))
    assert generate_tokens(model, PROMPTS, SamplingParams(max_new_tokens=16, temperature=2.0, top_k=1)) == greedy
    assert generate_tokens(model, PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.5, top_p=1e-6)) == greedy


def test_stop_tokens_end_their_row_only():
    model = tiny_gpt()
    greedy = generate_tokens(model, PROMPTS, SamplingParams(max_new_tokens=10))
    stop = greedy[0][3]
    stopped = generate_tokens(model, PROMPTS, SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))
    for row, tokens in enumerate(greedy):
        expected = tokens[: tokens.index(stop)] if stop in tokens else tokens
        assert stopped[row] == expected
    seen = []
    streamed = generate_tokens(
        model, PROMPTS, SamplingParams(max_new_tokens=10), on_token=lambda row, token: seen.append(row) or row == 1
    )
    assert streamed[1] == greedy[1][:1] and streamed[0] == greedy[0] and seen.count(1) == 1


@pytest.mark.parametrize(
    ("prompts", "options", "message"),
    [
        ([], {}, r"prompts=\[\]: give at least one prompt"),
        ([[1], []], {}, r"prompts\[1\] is empty"),
        ([[1, 300]], {}, r"prompts\[0\] holds token ids outside the model's vocabulary \[0, 256\)"),
        ([[1] * 30], {"max_new_tokens": 3}, r"30 tokens and max_new_tokens=3 exceed the model's seq_length=32"),
    ],
)
def test_bad_prompts_are_named(prompts, options, message):
    with pytest.raises(ValueError, match=message):
        generate_tokens(tiny_gpt(), prompts, SamplingParams(**options))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_new_tokens": 0}, r"max_new_tokens=0: use a positive integer"),
        ({"temperature": -1.0}, r"temperature=-1.0: use 0 \(greedy\) or more"),
        ({"top_k": -2}, r"top_k=-2"),
        ({"top_p": 0.0}, r"top_p=0.0: use a probability in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5"),
        ({"seed": "x"}, r"seed='x'"),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids=\(-1,\)"),
        ({"stop_strings": ("",)}, r"stop_strings=\(''.*\): use non-empty strings"),
    ],
)
def test_bad_sampling_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)

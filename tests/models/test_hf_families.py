"""Hugging Face families beyond Llama 2/3: Llama 3.1 rope scaling, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k
norms, explicit head_dim), Mixtral (MoE). Each: logits equal to transformers' on a tiny random model made here, a
bit-exact export that transformers loads, and a checkpoint trained under FSDP2 and TP=2 (Mixtral also with its
experts split over 2 ranks) that exports to logits equal to ours."""

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nemo_ckpt.checkpoint.context import save_context  # noqa: E402
from nemo_ckpt.models import GPTModel, gpt_config  # noqa: E402
from nemo_ckpt.models.gpt.convert import export_hf, import_hf  # noqa: E402
from nemo_ckpt.models.gpt.convert.safetensors_io import open_model_weights  # noqa: E402
from tests.models.test_hf import TINY_LLAMA, hf_logits, our_logits  # noqa: E402

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # shorter than the 24 tokens below: the scaling changes the logits
}
FAMILIES = {
    "llama3.1": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_parameters": LLAMA31_ROPE}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "mistral-window-covers-sequence": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 64},
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"num_key_value_heads": 2}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16, "tie_word_embeddings": True}),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
}


def make_hf_model(directory: Path, family: str, **overrides) -> Path:
    """A tiny random model of `family` saved to `directory` (no download)."""
    config_class, model_class, options = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**{**TINY_LLAMA, **options, **overrides}))
    with torch.no_grad():  # random biases and norms, so that a missing or misplaced one changes the logits
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers_and_exports_bit_exact(tmp_path, family):
    source = make_hf_model(tmp_path / "hf", family)
    checkpoint = import_hf(source, tmp_path / "ours")
    tokens = torch.randint(100, (2, 24))
    expected = hf_logits(source, tokens)
    assert (our_logits(checkpoint, tokens) - expected).abs().max() < 1e-5
    exported = export_hf(checkpoint, tmp_path / "back")
    original, back = open_model_weights(source), open_model_weights(exported)
    assert original.keys() - {"lm_head.weight"} == back.keys() - {"lm_head.weight"}
    for key in back:
        assert torch.equal(back[key], original[key]), key
    torch.testing.assert_close(hf_logits(exported, tokens), expected, atol=0, rtol=0)


def test_llama31_scaling_changes_the_logits(tmp_path):
    scaled = import_hf(make_hf_model(tmp_path / "scaled", "llama3.1"), tmp_path / "ours-scaled")
    plain = import_hf(make_hf_model(tmp_path / "plain", "llama3.1", rope_parameters=None), tmp_path / "ours-plain")
    tokens = torch.randint(100, (1, 24))
    assert (our_logits(scaled, tokens) - our_logits(plain, tokens)).abs().max() > 1e-3


REFUSED = {
    "sliding window": ("mistral", {"sliding_window": 8}, r"sliding_window=8 masks attention beyond 8 tokens"),
    "qwen2 sliding window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8},
        r"sliding_window=8 masks attention",
    ),
    "llama attention bias": ("llama3.1", {"attention_bias": True}, r"attention_bias=True is not supported"),
    "other rope": ("llama3.1", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, r"rope type 'yarn'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_does_not_convert_is_refused_by_name(tmp_path, case):
    family, overrides, message = REFUSED[case]
    source = make_hf_model(tmp_path / "hf", family, **overrides)
    with pytest.raises(ValueError, match=message):
        import_hf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_other_architectures_are_refused_naming_the_supported_ones(tmp_path):
    source = make_hf_model(tmp_path / "hf", "mistral")
    config = (source / "config.json").read_text()
    (source / "config.json").write_text(
        config.replace('"MistralForCausalLM"', '"GemmaForCausalLM"').replace('"mistral"', '"gemma"')
    )
    with pytest.raises(ValueError, match=r"\['GemmaForCausalLM'\] is not supported; these convert: LlamaForCausalLM, "):
        import_hf(source, tmp_path / "out")


TRAINED = {  # each family's options in a tiny GPT trained under FSDP2 and TP=2 (and EP=2 for MoE)
    "qwen2-llama31-rope": {
        "add_qkv_bias": True,
        "rope_scaling": True,
        "rope_original_max_position_embeddings": 16,
    },
    "qwen3": {"qk_layernorm": True, "kv_channels": 32},
    "mixtral": {"num_moe_experts": 4, "moe_ffn_hidden_size": 64, "moe_router_topk": 2},
}
LAYOUTS = {
    "fsdp2": {"ddp": {"data_parallel_sharding_strategy": "optim_grads_params"}},
    "tp2": {"ddp": {}, "tensor_model_parallel_size": 2},
    "ep2": {"ddp": {}, "expert_model_parallel_size": 2},
}


def test_checkpoints_trained_under_fsdp2_and_tp_export_to_transformers(tmp_path):
    from tests.helpers.distributed import run_distributed
    from tests.models.two_rank_training import train_and_save

    runs = {
        f"{name}-{layout}": {**options, "model_overrides": TRAINED[name]}
        for name in TRAINED
        for layout, options in LAYOUTS.items()
        if layout != "ep2" or "num_moe_experts" in TRAINED[name]
    }
    run_distributed(train_and_save, 2, runs, tmp_path)
    tokens = torch.randint(256, (2, 32))
    for run in runs:
        checkpoint = tmp_path / run
        save_context(checkpoint, model=GPTModel(gpt_config("tiny", **runs[run]["model_overrides"])))
        exported = export_hf(checkpoint, tmp_path / f"{run}-hf")
        assert (hf_logits(exported, tokens) - our_logits(checkpoint, tokens)).abs().max() < 1e-5, run

"""NeMo 2.0's GPT model and config classes, as data: the allow-list a NeMo 2.0 checkpoint's `context/io.json` is read
against (`nemo2.py`), never importing NeMo.

NeMo's `IOMixin` stores only the arguments a config was constructed with (`Llama32Config1B()` is stored with none),
so the defaults each class sets are needed to know the model. `CONFIG_CLASSES` holds, per class, its parent and the
defaults it sets of the fields that decide the model's weights and forward; `TRANSFORMER_CONFIG_DEFAULTS` those of
megatron-core's `TransformerConfig` below them all. Read from nemo-toolkit 2.5.3
(`nemo/collections/llm/gpt/model/{base,llama,mistral,qwen2,qwen3,mixtral}.py`) and megatron-core 0.19.2
(`tests/models/test_nemo2.py` checks the latter against the installed megatron-core).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PyRef:
    """A Python symbol a Fiddle config names (`{"type": "pyref", ...}`), kept as its name: nothing is imported."""

    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


SILU = PyRef("torch.nn.functional", "silu")
LLM = "nemo.collections.llm.gpt.model"
TRAINER_CONTEXT = "nemo.lightning.io.pl.TrainerContext"
AUTO_TOKENIZER = "nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer"
SENTENCEPIECE_TOKENIZER = "nemo.collections.common.tokenizers.sentencepiece_tokenizer.SentencePieceTokenizer"
STRING_ARTIFACT = "nemo.lightning.io.artifact.file.DirOrStringArtifact"  # a tokenizer named by hub id, not stored

TRANSFORMER_CONFIG_DEFAULTS: Mapping[str, Any] = {
    "num_layers": 0,
    "hidden_size": 0,
    "num_attention_heads": 0,
    "num_query_groups": None,
    "ffn_hidden_size": None,
    "kv_channels": None,
    "normalization": "LayerNorm",
    "activation_func": PyRef("torch.nn.functional", "gelu"),
    "gated_linear_unit": False,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "qk_layernorm": False,
    "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False,
    "init_method_std": 0.02,
    "window_size": None,
    "rotary_interleaved": False,
    "multi_latent_attention": False,
    "apply_residual_connection_post_layernorm": False,
    "softmax_scale": None,
    "attention_output_gate": False,
    "calculate_per_token_loss": False,
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "num_moe_experts": None,
    "moe_layer_freq": 1,
    "moe_ffn_hidden_size": None,
    "moe_router_topk": 2,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "moe_shared_expert_intermediate_size": None,
    "moe_router_topk_scaling_factor": None,
    "moe_router_num_groups": None,
    "moe_router_enable_expert_bias": False,
    "moe_shared_expert_gate": False,
}


@dataclass(frozen=True)
class ConfigClass:
    """A NeMo config class: the class it derives from (None: megatron-core's `TransformerConfig`) and the defaults it
    sets; `rope_scaling`: Llama 3.1's rotary scaling (`scale_factor`, `low_freq_factor`, ...) applies."""

    parent: str | None
    defaults: Mapping[str, Any]
    rope_scaling: bool = False


_LLAMA = {
    "normalization": "RMSNorm",
    "activation_func": SILU,
    "gated_linear_unit": True,
    "position_embedding_type": "rope",
    "add_bias_linear": False,
    "seq_length": 4096,
    "share_embeddings_and_output_weights": False,
}
_LLAMA31_SCALING = {"scale_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "old_context_len": 8192}


def _shape(layers: int, hidden: int, heads: int, ffn: int, groups: int | None = None, **more: Any) -> dict[str, Any]:
    shape = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "ffn_hidden_size": ffn}
    return shape | ({} if groups is None else {"num_query_groups": groups}) | more


_L3 = {"rotary_base": 500000, "seq_length": 8192}
_L31 = {"rotary_base": 500000, "seq_length": 131072}
_Q25 = {"seq_length": 131072}
CONFIG_CLASSES: Mapping[str, ConfigClass] = {
    f"{LLM}.base.GPTConfig": ConfigClass(
        None,
        {
            "share_embeddings_and_output_weights": True,
            "make_vocab_size_divisible_by": 128,
            "position_embedding_type": "learned_absolute",
            "rotary_base": 10000,
            "rotary_percent": 1.0,
            "seq_len_interpolation_factor": None,
            "seq_length": 1024,
            "vocab_size": None,
        },
    ),
    f"{LLM}.llama.LlamaConfig": ConfigClass(f"{LLM}.base.GPTConfig", _LLAMA),
    f"{LLM}.llama.Llama2Config7B": ConfigClass(f"{LLM}.llama.LlamaConfig", _shape(32, 4096, 32, 11008, 32)),
    f"{LLM}.llama.Llama2Config13B": ConfigClass(f"{LLM}.llama.LlamaConfig", _shape(40, 5120, 40, 13824, 40)),
    f"{LLM}.llama.Llama2Config70B": ConfigClass(f"{LLM}.llama.LlamaConfig", _shape(80, 8192, 64, 28672, 8)),
    f"{LLM}.llama.Llama3Config": ConfigClass(
        f"{LLM}.llama.LlamaConfig",
        _LLAMA | {"num_query_groups": 8, "init_method_std": 0.01, "layernorm_epsilon": 1e-5, "rotary_percent": 1.0},
    ),
    f"{LLM}.llama.Llama3Config8B": ConfigClass(f"{LLM}.llama.Llama3Config", _shape(32, 4096, 32, 14336, **_L3)),
    f"{LLM}.llama.Llama3Config70B": ConfigClass(
        f"{LLM}.llama.Llama3Config", _shape(80, 8192, 64, 28672, init_method_std=0.008944, **_L3)
    ),
    f"{LLM}.llama.Llama31Config": ConfigClass(
        f"{LLM}.llama.Llama3Config", _LLAMA31_SCALING | {"init_method_std": 0.02}, rope_scaling=True
    ),
    f"{LLM}.llama.Llama31Config8B": ConfigClass(
        f"{LLM}.llama.Llama31Config", _shape(32, 4096, 32, 14336, **_L31), rope_scaling=True
    ),
    f"{LLM}.llama.Llama31Config70B": ConfigClass(
        f"{LLM}.llama.Llama31Config", _shape(80, 8192, 64, 28672, **_L31), rope_scaling=True
    ),
    f"{LLM}.llama.Llama31Config405B": ConfigClass(
        f"{LLM}.llama.Llama31Config", _shape(126, 16384, 128, 53248, **_L31), rope_scaling=True
    ),
    f"{LLM}.llama.Llama32Config1B": ConfigClass(
        f"{LLM}.llama.Llama31Config",
        _shape(16, 2048, 32, 8192, 8, scale_factor=32.0, share_embeddings_and_output_weights=True, **_L31),
        rope_scaling=True,
    ),
    f"{LLM}.llama.Llama32Config3B": ConfigClass(
        f"{LLM}.llama.Llama31Config",
        _shape(28, 3072, 24, 8192, 8, scale_factor=32.0, share_embeddings_and_output_weights=True, **_L31),
        rope_scaling=True,
    ),
    f"{LLM}.mistral.MistralConfig7B": ConfigClass(
        f"{LLM}.base.GPTConfig",
        _LLAMA
        | _shape(32, 4096, 32, 14336, 8)
        | {"seq_length": 32768, "init_method_std": 0.02, "layernorm_epsilon": 1e-5, "window_size": (4096, 0)},
    ),
    f"{LLM}.mistral.MistralNeMoConfig12B": ConfigClass(
        f"{LLM}.mistral.MistralConfig7B",
        {"num_layers": 40, "hidden_size": 5120, "kv_channels": 128, "seq_length": 4096, "window_size": None}
        | {"rotary_percent": 1.0, "rotary_base": 1000000.0},
    ),
    f"{LLM}.qwen2.Qwen2Config": ConfigClass(
        f"{LLM}.base.GPTConfig",
        _LLAMA
        | {"add_qkv_bias": True, "init_method_std": 0.02, "vocab_size": 151936, "layernorm_epsilon": 1e-6}
        | {"rotary_base": 1000000.0},
    ),
    f"{LLM}.qwen2.Qwen2Config500M": ConfigClass(f"{LLM}.qwen2.Qwen2Config", _shape(24, 896, 14, 4864, 2)),
    f"{LLM}.qwen2.Qwen25Config500M": ConfigClass(f"{LLM}.qwen2.Qwen2Config500M", _Q25),
    f"{LLM}.qwen2.Qwen2Config1P5B": ConfigClass(f"{LLM}.qwen2.Qwen2Config", _shape(28, 1536, 12, 8960, 2)),
    f"{LLM}.qwen2.Qwen25Config1P5B": ConfigClass(f"{LLM}.qwen2.Qwen2Config1P5B", _Q25),
    f"{LLM}.qwen2.Qwen25Config3B": ConfigClass(
        f"{LLM}.qwen2.Qwen2Config", _shape(36, 2048, 16, 11008, 2, share_embeddings_and_output_weights=True)
    ),
    f"{LLM}.qwen2.Qwen2Config7B": ConfigClass(
        f"{LLM}.qwen2.Qwen2Config", _shape(28, 3584, 28, 18944, 4, vocab_size=152064)
    ),
    f"{LLM}.qwen2.Qwen25Config7B": ConfigClass(f"{LLM}.qwen2.Qwen2Config7B", _Q25),
    f"{LLM}.qwen2.Qwen25Config14B": ConfigClass(
        f"{LLM}.qwen2.Qwen2Config", _shape(48, 5120, 40, 13824, 8, vocab_size=152064, layernorm_epsilon=1e-5, **_Q25)
    ),
    f"{LLM}.qwen2.Qwen25Config32B": ConfigClass(
        f"{LLM}.qwen2.Qwen2Config", _shape(64, 5120, 40, 27648, 8, vocab_size=152064, layernorm_epsilon=1e-5, **_Q25)
    ),
    f"{LLM}.qwen2.Qwen2Config72B": ConfigClass(
        f"{LLM}.qwen2.Qwen2Config", _shape(80, 8192, 64, 29568, 8, vocab_size=152064, layernorm_epsilon=1e-5)
    ),
    f"{LLM}.qwen2.Qwen25Config72B": ConfigClass(f"{LLM}.qwen2.Qwen2Config72B", _Q25),
    f"{LLM}.qwen3.Qwen3Config": ConfigClass(
        f"{LLM}.qwen2.Qwen2Config",
        {"add_qkv_bias": False, "qk_layernorm": True, "kv_channels": 128, "num_query_groups": 8}
        | {"vocab_size": 151936},
    ),
    f"{LLM}.qwen3.Qwen3Config600M": ConfigClass(
        f"{LLM}.qwen3.Qwen3Config", _shape(28, 1024, 16, 3072, share_embeddings_and_output_weights=True)
    ),
    f"{LLM}.qwen3.Qwen3Config1P7B": ConfigClass(
        f"{LLM}.qwen3.Qwen3Config", _shape(28, 2048, 16, 6144, share_embeddings_and_output_weights=True)
    ),
    f"{LLM}.qwen3.Qwen3Config4B": ConfigClass(
        f"{LLM}.qwen3.Qwen3Config", _shape(36, 2560, 32, 9728, share_embeddings_and_output_weights=True)
    ),
    f"{LLM}.qwen3.Qwen3Config8B": ConfigClass(f"{LLM}.qwen3.Qwen3Config", _shape(36, 4096, 32, 12288)),
    f"{LLM}.qwen3.Qwen3Config14B": ConfigClass(f"{LLM}.qwen3.Qwen3Config", _shape(40, 5120, 40, 17408)),
    f"{LLM}.qwen3.Qwen3Config32B": ConfigClass(f"{LLM}.qwen3.Qwen3Config", _shape(64, 5120, 64, 25600)),
    f"{LLM}.qwen3.Qwen3MoEConfig": ConfigClass(
        f"{LLM}.qwen3.Qwen3Config",
        {"num_moe_experts": 128, "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.001}
        | {"moe_router_topk": 8, "moe_router_pre_softmax": False},
    ),
    f"{LLM}.qwen3.Qwen3Config30B_A3B": ConfigClass(
        f"{LLM}.qwen3.Qwen3MoEConfig", _shape(48, 2048, 32, 6144, 4, moe_ffn_hidden_size=768)
    ),
    f"{LLM}.qwen3.Qwen3Config235B_A22B": ConfigClass(
        f"{LLM}.qwen3.Qwen3MoEConfig", _shape(94, 4096, 64, 12288, 4, moe_ffn_hidden_size=1536)
    ),
    f"{LLM}.mixtral.MixtralConfig": ConfigClass(
        f"{LLM}.base.GPTConfig",
        _LLAMA
        | _shape(32, 4096, 32, 14336, 8)
        | {"seq_length": 4096, "num_moe_experts": 8, "moe_aux_loss_coeff": 0.01, "moe_router_topk": 2}
        | {"moe_router_pre_softmax": False, "moe_router_load_balancing_type": "aux_loss", "init_method_std": 0.02}
        | {"layernorm_epsilon": 1e-5, "rotary_percent": 1.0, "rotary_base": 1000000.0},
    ),
}

# The model classes whose `config` argument holds one of CONFIG_CLASSES.
MODEL_CLASSES = (
    f"{LLM}.base.GPTModel",
    f"{LLM}.llama.LlamaModel",
    f"{LLM}.mistral.MistralModel",
    f"{LLM}.qwen2.Qwen2Model",
    f"{LLM}.qwen3.Qwen3Model",
    f"{LLM}.mixtral.MixtralModel",
)


def class_defaults(name: str) -> dict[str, Any]:
    """The defaults of config class `name` (a key of CONFIG_CLASSES), its ancestors' below its own."""
    chain = []
    while name is not None:
        chain.append(CONFIG_CLASSES[name])
        name = CONFIG_CLASSES[name].parent
    defaults = dict(TRANSFORMER_CONFIG_DEFAULTS)
    for config_class in reversed(chain):
        defaults |= config_class.defaults
    return defaults

"""Hugging Face Llama-family models <-> our GPT checkpoints.

Families (`FAMILIES`): `LlamaForCausalLM` (Llama 2, 3, and 3.1+ with `rope_type: "llama3"` scaling),
`MistralForCausalLM` (no sliding window, or one at least as long as the sequence), `Qwen2ForCausalLM` (q/k/v
biases: `GPTConfig.add_qkv_bias`) and `Qwen3ForCausalLM` (per-head q/k RMSNorm: `qk_layernorm`, explicit
`head_dim`: `kv_channels`) and `MixtralForCausalLM` (our MoE layers: router `block_sparse_moe.gate`, experts
`w1`/`w3`/`w2` = gate/up/down; softmax over the top-k logits is Mixtral's renormalized top-k). Any other
architecture is refused, naming it and the supported ones.

`import_hf` turns a local Hugging Face directory (`config.json` + `*.safetensors`, sharded or not) into a checkpoint
of ours: `weights/` (a `dist_checkpointing` checkpoint under the keys training uses, e.g.
`module.layers.0.self_attention.q_proj.weight`), `context/model.json` (a `GPTModel` with the `GPTConfig` derived
from `config.json`) and `context/hf/` (the source's config, generation config and tokenizer files, for the export).
`export_hf` writes a checkpoint of any layout (single process, FSDP2, TP: keys and tensors are layout-independent)
back to a directory `transformers.AutoModelForCausalLM` and `AutoTokenizer` load: the weights, `config.json`,
`generation_config.json` and the tokenizer the checkpoint stores (`checkpoint/hf_tokenizer.py`), its bos/eos/pad ids
in both configs. A model the converter cannot write (an MoE model Mixtral cannot express) raises
`UnsupportedModelError` before anything is written.

Both stream: the import memory-maps the source files, the export reads and writes one tensor at a time. Both
write to a temporary name beside the output and rename it at the end, so an output is whole or absent.

The weights need no permutation: Hugging Face's Llama checkpoints and our `apply_rotary` both use the rotate-half
rotary layout (pairs `(i, i + head_dim / 2)`), and our q/k/v/o and gate/up/down projections are Llama's.
"""

import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import save_context
from nemo_ckpt.checkpoint.hf_tokenizer import (
    TOKENIZER_FILES,
    has_tokenizer,
    special_token_ids,
    stored_tokenizer_files,
    vocabulary_size,
    write_files,
)
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir, weights_dir
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.models.gpt.convert.checkpoint_io import (
    ConversionOutput,
    check_convertible,
    checkpoint_gpt_config,
    checkpoint_tensor_reader,
)
from nemo_ckpt.models.gpt.convert.safetensors_io import (
    MalformedModelError,
    TensorSpec,
    open_model_weights,
    write_model_weights,
)
from nemo_ckpt.models.gpt.lightning import GPTModel
from nemo_ckpt.models.gpt.model import GPT, GPTConfig, padded_vocab_size
from nemo_ckpt.models.gpt.moe import moe_layer_pattern

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE)
ARTIFACT_FILES = (*MODEL_CONFIG_FILES, *TOKENIZER_FILES)
DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
VOCAB_KEYS = ("module.embedding.weight", "module.output_layer.weight")
IGNORED_HF_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
OPTIONAL_POSITIVE_INTS = (
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
    "num_local_experts",
    "num_experts_per_tok",
)
POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps", "initializer_range")


@dataclass(frozen=True)
class Family:
    """A Hugging Face architecture our GPT converts: its `model_type` and the options it fixes."""

    architecture: str
    model_type: str
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    moe: bool = False


FAMILIES = {
    family.model_type: family
    for family in (
        Family("LlamaForCausalLM", "llama"),
        Family("MistralForCausalLM", "mistral"),
        Family("Qwen2ForCausalLM", "qwen2", add_qkv_bias=True),
        Family("Qwen3ForCausalLM", "qwen3", qk_layernorm=True),
        Family("MixtralForCausalLM", "mixtral", moe=True),
    )
}
SUPPORTED_ARCHITECTURES = [family.architecture for family in FAMILIES.values()]

# (ours, Hugging Face) key patterns; `{}` is the layer number.
_LAYER_KEYS = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.q_proj.weight", "self_attn.q_proj.weight"),
    ("self_attention.k_proj.weight", "self_attn.k_proj.weight"),
    ("self_attention.v_proj.weight", "self_attn.v_proj.weight"),
    ("self_attention.o_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)
_DENSE_MLP_KEYS = (
    ("mlp.gate_proj.weight", "mlp.gate_proj.weight"),
    ("mlp.up_proj.weight", "mlp.up_proj.weight"),
    ("mlp.down_proj.weight", "mlp.down_proj.weight"),
)
_MIXTRAL_EXPERT_NAMES = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
_QKV_BIAS_KEYS = tuple((f"self_attention.{p}_proj.bias", f"self_attn.{p}_proj.bias") for p in "qkv")
_QK_NORM_KEYS = (
    ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)
_GLOBAL_KEYS = {
    "module.embedding.weight": "model.embed_tokens.weight",
    "module.final_layernorm.weight": "model.norm.weight",
    "module.output_layer.weight": "lm_head.weight",
}


def hf_key_map(config: GPTConfig) -> dict[str, str]:
    """Our checkpoint key -> the Hugging Face Llama key, for every tensor of a GPT with `config`."""
    keys = {ours: hf for ours, hf in _GLOBAL_KEYS.items()}
    if config.share_embeddings_and_output_weights:
        del keys["module.output_layer.weight"]
    layer_keys = _LAYER_KEYS + _QKV_BIAS_KEYS * config.add_qkv_bias + _QK_NORM_KEYS * config.qk_layernorm
    for layer, is_moe in enumerate(moe_layer_pattern(config)):
        mlp_keys = _moe_keys(config.num_moe_experts) if is_moe else _DENSE_MLP_KEYS
        for ours, hf in layer_keys + mlp_keys:
            keys[f"module.layers.{layer}.{ours}"] = f"model.layers.{layer}.{hf}"
    return keys


def _moe_keys(num_experts: int) -> tuple[tuple[str, str], ...]:
    """(ours, Mixtral's) keys of an MoE layer's router and experts."""
    experts = tuple(
        (f"mlp.experts.{expert}.{ours}.weight", f"block_sparse_moe.experts.{expert}.{theirs}.weight")
        for expert in range(num_experts)
        for ours, theirs in _MIXTRAL_EXPERT_NAMES
    )
    return (("mlp.router.weight", "block_sparse_moe.gate.weight"), *experts)


def gpt_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Our checkpoint key -> shape, for every tensor of a GPT with `config` (built on `meta`, no memory)."""
    with torch.device("meta"):
        module = GPT(config)
    return {f"module.{key}": tuple(tensor.shape) for key, tensor in module.state_dict().items()}


LLAMA3_ROPE = {  # rope_parameters key -> GPTConfig field
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
}


def _rope(hf: dict[str, Any], path: Path) -> dict[str, Any]:
    """The GPTConfig rotary fields of `hf` (`rope_parameters`, or the older `rope_scaling` / `rope_theta`)."""
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(rope, dict) or not isinstance(scaling, dict):
        raise MalformedModelError(f"{path}: rope_parameters or rope_scaling is not a JSON object")
    rope = {**scaling, **rope}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ("default", "llama3"):
        raise ValueError(
            f"{path}: rope type {rope_type!r} (rope_scaling / rope_parameters) is not supported; our GPT implements "
            "the default rotary embedding and Llama 3.1's ('llama3')"
        )
    values = {"rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0))}
    if rope_type == "llama3":
        missing = [key for key in LLAMA3_ROPE if key not in rope]
        if missing:
            raise MalformedModelError(f"{path}: rope type 'llama3' lacks {missing}")
        values |= {key: rope[key] for key in LLAMA3_ROPE}
    for key, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
            raise MalformedModelError(f"{path}: {key}={value!r} is not a positive number")
    fields = {"rotary_base": float(values.pop("rope_theta")), "rope_scaling": rope_type == "llama3"}
    return fields | {LLAMA3_ROPE[key]: value for key, value in values.items()}


def _family(hf: dict[str, Any], path: Path) -> Family:
    architectures = hf.get("architectures") or [hf.get("model_type")]
    if not isinstance(architectures, list):
        raise MalformedModelError(f"{path}: architectures={architectures!r} is not a list")
    for family in FAMILIES.values():
        if family.architecture in architectures or hf.get("model_type") == family.model_type:
            return family
    raise ValueError(
        f"{path}: architectures={architectures} is not supported; these convert: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _check_attention_window(hf: dict[str, Any], family: Family, path: Path) -> None:
    """Refuse a sliding attention window shorter than the sequence (our attention sees every earlier token)."""
    window = hf.get("sliding_window")
    used = family.model_type == "mistral" or hf.get("use_sliding_window", False)
    length = hf.get("max_position_embeddings", 2048)
    if used and window is not None and window < length:
        raise ValueError(
            f"{path}: sliding_window={window} masks attention beyond {window} tokens of the "
            f"max_position_embeddings={length}; our GPT does not implement sliding-window attention (models whose "
            "window is None or covers the sequence convert)"
        )


def gpt_config_from_hf(hf: dict[str, Any], path: Path, make_vocab_size_divisible_by: int = 1) -> GPTConfig:
    """The `GPTConfig` of a Hugging Face `config.json` of a supported family (read from `path`); bad fields raise,
    naming them."""
    family = _family(hf, path)
    missing = [key for key in POSITIVE_INTS if key not in hf]
    if missing:
        raise ValueError(f"{path} lacks {missing}, which a {family.architecture} config.json holds")
    _check_config_values(hf, path)
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "mlp_bias": (hf.get("mlp_bias", False), False),
    }
    if not family.add_qkv_bias:  # Llama's, Qwen3's attention_bias adds an output bias too
        unsupported["attention_bias"] = (hf.get("attention_bias", False), False)
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise ValueError(f"{path}: {key}={value!r} is not supported (our GPT has {key}={supported!r})")
    _check_attention_window(hf, family, path)
    head_dim = hf.get("head_dim")
    moe = {}
    if family.moe:
        moe = {
            "num_moe_experts": hf.get("num_local_experts", 8),
            "moe_router_topk": hf.get("num_experts_per_tok", 2),
            "moe_ffn_hidden_size": hf["intermediate_size"],
            "moe_aux_loss_coeff": hf.get("router_aux_loss_coef", 0.0),
        }
    return GPTConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=padded_vocab_size(hf["vocab_size"], make_vocab_size_divisible_by),
        seq_length=hf.get("max_position_embeddings", 2048),
        kv_channels=None if head_dim in (None, hf["hidden_size"] // hf["num_attention_heads"]) else head_dim,
        add_qkv_bias=family.add_qkv_bias,
        qk_layernorm=family.qk_layernorm,
        **_rope(hf, path),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        init_method_std=hf.get("initializer_range", 0.02),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        **moe,
    )


def _check_config_values(hf: dict[str, Any], path: Path) -> None:
    """Raise `MalformedModelError` naming the first field of `hf` of the wrong type or out of range."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    def is_number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")

    checks = [(key, is_int, "integer") for key in POSITIVE_INTS]
    checks += [(key, is_int, "integer") for key in OPTIONAL_POSITIVE_INTS if hf.get(key) is not None]
    checks += [(key, is_number, "number") for key in POSITIVE_NUMBERS if key in hf]
    for key, valid, kind in checks:
        if not valid(hf[key]):
            raise MalformedModelError(f"{path}: {key}={hf[key]!r} is not a positive {kind}")
    if not isinstance(hf.get("tie_word_embeddings", False), bool):
        raise MalformedModelError(f"{path}: tie_word_embeddings={hf['tie_word_embeddings']!r} is not a boolean")
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if (hf.get("head_dim") is None and hf["hidden_size"] % heads) or heads % groups:
        raise MalformedModelError(
            f"{path}: hidden_size={hf['hidden_size']}, num_attention_heads={heads} and num_key_value_heads={groups} "
            "do not divide (hidden_size by heads, unless head_dim is given; heads by key/value heads)"
        )


def check_config_against_weights(hf: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Raise `MalformedModelError` unless `hf`'s number of layers, vocabulary and hidden size are those of the
    weights present (before anything of that size is built or allocated)."""
    layers = sorted({int(match.group(1)) for key in tensors if (match := HF_LAYER_KEY.match(key))})
    if len(layers) != hf["num_hidden_layers"] or layers != list(range(len(layers))):
        shown = layers if len(layers) <= 8 else [*layers[:4], "...", *layers[-2:]]
        raise MalformedModelError(
            f"{path}: num_hidden_layers={hf['num_hidden_layers']}, but the weights hold layers {shown} "
            f"({len(layers)} layers)"
        )
    embedding = tensors.get(_GLOBAL_KEYS["module.embedding.weight"])
    expected = (hf["vocab_size"], hf["hidden_size"])
    if embedding is None or tuple(embedding.shape) != expected:
        found = "no such tensor" if embedding is None else f"shape {list(embedding.shape)}"
        raise MalformedModelError(
            f"{path}: vocab_size={expected[0]} and hidden_size={expected[1]}, but "
            f"{_GLOBAL_KEYS['module.embedding.weight']} has {found}"
        )


def hf_config_from_gpt(config: GPTConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A Hugging Face `config.json` for a GPT with `config` (for checkpoints not imported from one), of the family
    whose options it has (`export_family`)."""
    family = export_family(config)
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": config.rotary_base}
        rope |= {key: getattr(config, field) for key, field in LLAMA3_ROPE.items()}
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_hidden_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.seq_length,
        "rope_theta": config.rotary_base,
        "rope_parameters": rope,
        "rms_norm_eps": config.layernorm_epsilon,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": config.share_embeddings_and_output_weights,
        "dtype": str(dtype).removeprefix("torch."),
    } | _mixtral_fields(config)


def _mixtral_fields(config: GPTConfig) -> dict[str, Any]:
    if not config.num_moe_experts:
        return {}
    return {
        "num_local_experts": config.num_moe_experts,
        "num_experts_per_tok": config.moe_router_topk,
        "intermediate_size": config.moe_ffn_hidden_size or config.ffn_hidden_size,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "sliding_window": None,
    }


def export_family(config: GPTConfig) -> Family:
    """The family a GPT with `config` exports as: Mixtral with experts, Qwen3 with q/k norms, Qwen2 with q/k/v
    biases, else Llama (the first family with the same options); for a config `unsupported_features` accepts."""
    options = (bool(config.num_moe_experts), config.qk_layernorm, config.add_qkv_bias)
    return next(f for f in FAMILIES.values() if (f.moe, f.qk_layernorm, f.add_qkv_bias) == options)


def unsupported_features(config: GPTConfig) -> list[str]:
    """What of a GPT with `config` no Hugging Face family expresses: q/k/v biases with q/k norms; an MoE model
    other than Mixtral's (every layer MoE, softmax routing over the top-k logits, dropless, no shared expert, no
    biases or q/k norms)."""
    if config.qk_layernorm and config.add_qkv_bias:
        return [
            "add_qkv_bias=True with qk_layernorm=True: no Hugging Face family has both (Qwen2 has the biases, Qwen3 "
            "the norms)"
        ]
    if not config.num_moe_experts:
        return []
    mixtral = {
        "moe_layer_freq": (1 if all(moe_layer_pattern(config)) else config.moe_layer_freq, 1),
        "moe_router_score_function": (config.moe_router_score_function, "softmax"),
        "moe_router_pre_softmax": (config.moe_router_pre_softmax, False),
        "moe_expert_capacity_factor": (config.moe_expert_capacity_factor, None),
        "moe_shared_expert_intermediate_size": (config.moe_shared_expert_intermediate_size, None),
        "add_qkv_bias": (config.add_qkv_bias, False),
        "qk_layernorm": (config.qk_layernorm, False),
    }
    return [
        f"{name}={value!r} (Mixtral, the Hugging Face MoE family, has {name}={expected!r})"
        for name, (value, expected) in mixtral.items()
        if value != expected
    ]


def hf_artifact_sources(
    checkpoint: Path, artifacts_from: str | Path | None = None, base: str | Path | None = None
) -> tuple[Path | None, Path | None]:
    """The `context/hf` directories whose model config (`config.json`, `generation_config.json`) and tokenizer go
    with `checkpoint`'s weights (None: none has one): the config of the first of `artifacts_from`, `checkpoint` and
    `base` that holds one; the tokenizer of the first of `checkpoint`, `artifacts_from` and `base` (the tokenizer
    the weights were trained with, which `checkpoint` stores unless it predates stored tokenizers)."""
    configs = [hf_artifacts_dir(path) for path in (artifacts_from, checkpoint, base) if path is not None]
    tokenizers = [hf_artifacts_dir(path) for path in (checkpoint, artifacts_from, base) if path is not None]
    return (
        next((directory for directory in configs if (directory / CONFIG_FILE).is_file()), None),
        next((directory for directory in tokenizers if has_tokenizer(directory)), None),
    )


def copy_artifacts(config_dir: Path | None, tokenizer_dir: Path | None, target: Path) -> None:
    """Copy the model config files of `config_dir` and the tokenizer files of `tokenizer_dir` (either may be None)
    into `target` (a new checkpoint's `context/hf`)."""
    sources = [(config_dir, MODEL_CONFIG_FILES), (tokenizer_dir, TOKENIZER_FILES)]
    files = [directory / name for directory, names in sources if directory is not None for name in names]
    files = [path for path in files if path.is_file()]
    if files:
        target.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy2(path, target / path.name)


def _check_tokenizer(source: Path, vocab_size: int) -> None:
    tokenizer_file = source / "tokenizer.json"
    if not tokenizer_file.is_file():
        return
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(tokenizer_file)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the tokenizers library raises its own exception types for malformed files
        raise MalformedModelError(f"{tokenizer_file} is not a tokenizer: {e}") from e
    if size > vocab_size:
        raise ValueError(
            f"{tokenizer_file} has {size} tokens but {source / CONFIG_FILE} has vocab_size={vocab_size}: the "
            "tokenizer does not belong to these weights"
        )


def read_config(path: Path) -> dict[str, Any]:
    """A Hugging Face `config.json` as a dict; `MalformedModelError` if it is not a JSON object."""
    try:
        hf = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise MalformedModelError(f"{path} is not JSON: {e}") from e
    if not isinstance(hf, dict):
        raise MalformedModelError(f"{path} is not a JSON object")
    return hf


def import_hf(
    source: str | Path, output: str | Path, make_vocab_size_divisible_by: int = 1, overwrite: bool = False
) -> Path:
    """Convert the Hugging Face Llama directory `source` into our checkpoint at `output`; return `output`.

    The vocabulary is padded with zero rows to a multiple of `make_vocab_size_divisible_by`. Tensors keep their
    dtype (bf16 stays bf16; training loads them into its own parameter dtype).
    """
    source = Path(source)
    out = ConversionOutput(Path(output), overwrite)
    config_path = source / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist: pass a local Hugging Face model directory")
    hf = read_config(config_path)
    config = gpt_config_from_hf(hf, config_path, make_vocab_size_divisible_by)
    _check_tokenizer(source, hf["vocab_size"])
    tensors = open_model_weights(source)
    tensors = {key: value for key, value in tensors.items() if not IGNORED_HF_KEYS.fullmatch(key)}
    check_config_against_weights(hf, tensors, config_path)
    key_map = hf_key_map(config)
    if config.share_embeddings_and_output_weights:
        tensors.pop(_GLOBAL_KEYS["module.output_layer.weight"], None)  # a tied lm_head is a copy of the embedding
    unexpected = sorted(set(tensors) - set(key_map.values()))
    missing = sorted(set(key_map.values()) - set(tensors))
    if unexpected or missing:
        raise ValueError(
            f"{source}: the weights do not match {config_path} (a {config.num_layers}-layer Llama): "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    shapes = gpt_shapes(config)
    state = {}
    for ours, hf_key in key_map.items():
        tensor = tensors[hf_key]
        if ours in VOCAB_KEYS and tensor.shape[0] == hf["vocab_size"] < config.vocab_size:
            padding = tensor.new_zeros(config.vocab_size - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, padding])
        if tuple(tensor.shape) != shapes[ours]:
            raise ValueError(
                f"{source}: tensor {hf_key!r} has shape {list(tensor.shape)}, but {config_path} implies "
                f"{list(shapes[ours])}"
            )
        state[ours] = ShardedTensor.from_rank_offsets(ours, tensor, replica_id=0)
    tmp = out.start()
    try:
        target = weights_dir(tmp)
        target.mkdir()
        dist_checkpointing.save({"state_dict": state}, target, content_metadata={"source": "hf", "path": str(source)})
        save_context(tmp, model=GPTModel(config))
        artifacts = hf_artifacts_dir(tmp)
        artifacts.mkdir(parents=True)
        for name in ARTIFACT_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, artifacts / name)
    except BaseException:
        out.abort()
        raise
    return out.commit()


def _with_token_ids(config: dict[str, Any], ids: dict[str, int | None]) -> dict[str, Any]:
    """`config` (a config.json or generation_config.json) with the tokenizer's `ids`; an eos list that holds the
    tokenizer's eos (e.g. Llama 3's end-of-turn tokens) is kept."""
    config = dict(config)
    for key, value in ids.items():
        if not (isinstance(config.get(key), list) and value in config[key]):
            config[key] = value
    return config


def _export_configs(
    checkpoint: Path,
    config: GPTConfig,
    stored_dtype: torch.dtype,
    artifacts_from: str | Path | None,
    base: str | Path | None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, bytes]]:
    """The `config.json` and `generation_config.json` (empty: none) of `checkpoint`'s export, with the token ids of
    its tokenizer, and the tokenizer files (empty: none stored, with a warning); see `export_hf`."""
    config_dir, tokenizer_dir = hf_artifact_sources(checkpoint, artifacts_from, base)
    generation: dict[str, Any] = {}
    if config_dir is not None:
        hf = json.loads((config_dir / CONFIG_FILE).read_text())
        stored_config = gpt_config_from_hf(hf, config_dir / CONFIG_FILE)
        if (stored_config.hidden_size, stored_config.num_layers) != (config.hidden_size, config.num_layers):
            raise ValueError(
                f"{config_dir / CONFIG_FILE} describes another model than {checkpoint} (hidden_size, num_layers "
                f"{stored_config.hidden_size, stored_config.num_layers} vs {config.hidden_size, config.num_layers})"
            )
        if (config_dir / GENERATION_CONFIG_FILE).is_file():
            generation = json.loads((config_dir / GENERATION_CONFIG_FILE).read_text())
    else:
        hf = hf_config_from_gpt(config, stored_dtype)
    if tokenizer_dir is None:
        log.warning(
            "%s stores no tokenizer (a model trained on mock data, or saved before checkpoints stored their "
            "tokenizer): AutoTokenizer will not load its export; pass artifacts_from=<a checkpoint with one>",
            checkpoint,
        )
        return hf, generation, {}
    tokenizer = stored_tokenizer_files(tokenizer_dir)
    size = vocabulary_size(tokenizer)
    if size > hf["vocab_size"]:
        raise ValueError(
            f"The tokenizer of {tokenizer_dir} has {size} tokens but the exported model's vocab_size is "
            f"{hf['vocab_size']}: it is not the tokenizer of these weights"
        )
    ids = special_token_ids(tokenizer)
    return _with_token_ids(hf, ids), _with_token_ids(generation, ids), tokenizer


def export_hf(
    checkpoint: str | Path,
    output: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    artifacts_from: str | Path | None = None,
    base: str | Path | None = None,
    overwrite: bool = False,
    read_tensor: Callable[[str], torch.Tensor] | None = None,
) -> Path:
    """Write our GPT checkpoint `checkpoint` as a Hugging Face Llama directory at `output`; return `output`.

    `config.json` and `generation_config.json` come from the `context/hf/` of the first of `artifacts_from`,
    `checkpoint` and `base` (an adapter checkpoint's base) that holds a config.json (its vocabulary: an import's
    padding is cut back), else from the GPT's config (its `vocab_size` the model's, padding rows kept). The
    tokenizer comes from the first of `checkpoint`, `artifacts_from` and `base` that stores one (so the tokenizer
    the weights were trained with), its bos/eos/pad ids written into both configs. `dtype`: of the written weights
    (default: the config's `dtype`, else the checkpoint's). Weight files hold at most `max_shard_size` bytes each.
    `read_tensor`: loads one of our tensors by key (default: from `checkpoint`'s weights).
    """
    checkpoint = Path(checkpoint)
    out = ConversionOutput(Path(output), overwrite)
    config = checkpoint_gpt_config(checkpoint)
    check_convertible(unsupported_features(config), checkpoint, "export to Hugging Face")
    if read_tensor is None:
        metadata, read_tensor = checkpoint_tensor_reader(checkpoint)
        stored_dtype = metadata["module.embedding.weight"].dtype
    else:
        stored_dtype = read_tensor("module.final_layernorm.weight").dtype
    hf, generation, tokenizer = _export_configs(checkpoint, config, stored_dtype, artifacts_from, base)
    dtype = dtype or getattr(torch, hf.get("dtype") or hf.get("torch_dtype") or "", None) or stored_dtype
    hf["dtype"] = str(dtype).removeprefix("torch.")
    hf.pop("torch_dtype", None)
    vocab_size = hf["vocab_size"]
    shapes = gpt_shapes(config)
    key_map = hf_key_map(config)
    ours_of = {hf_key: ours for ours, hf_key in key_map.items()}
    specs = []
    for ours, hf_key in key_map.items():
        shape = shapes[ours]
        if ours in VOCAB_KEYS:
            shape = (vocab_size, *shape[1:])
        specs.append(TensorSpec(hf_key, dtype, shape))

    def produce(hf_key: str) -> torch.Tensor:
        ours = ours_of[hf_key]
        tensor = read_tensor(ours)
        if ours in VOCAB_KEYS:
            tensor = tensor[:vocab_size]
        return tensor.to(dtype)

    tmp = out.start()
    try:
        write_model_weights(tmp, specs, produce, max_shard_size)
        (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if generation:
            (tmp / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        write_files(tokenizer, tmp)
    except BaseException:
        out.abort()
        raise
    return out.commit()

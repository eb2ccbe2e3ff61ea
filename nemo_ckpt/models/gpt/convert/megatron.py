"""Megatron-Core GPT naming (NeMo 2.0 `torch_dist` checkpoints of Llama models) <-> our GPT keys.

Megatron-Core's GPT (`megatron.core.models.gpt.GPTModel`, Transformer Engine layer spec) stores, under NeMo 2.0's
`module.` prefix and with the layers of the decoder stacked along a leading axis of size `num_layers`
(`decoder.layers.<name>`, global shape `[num_layers, ...]`, as `TransformerBlock.sharded_state_dict` writes
homogeneous layers):

    embedding.word_embeddings.weight                 <- embedding.weight
    decoder.layers.self_attention.linear_qkv.weight  <- q/k/v_proj, interleaved per query group:
                                                        [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]
    decoder.layers.self_attention.linear_qkv.bias    <- q/k/v_proj biases, interleaved the same way (add_qkv_bias)
    decoder.layers.self_attention.linear_qkv.layer_norm_weight  <- input_layernorm.weight (fused into the linear)
    decoder.layers.self_attention.q_layernorm.weight <- q_layernorm.weight, and k_layernorm (qk_layernorm)
    decoder.layers.self_attention.linear_proj.weight <- o_proj
    decoder.layers.mlp.linear_fc1.weight             <- [gate_proj; up_proj] (SwiGLU: silu(first half) * second)
    decoder.layers.mlp.linear_fc1.layer_norm_weight  <- pre_mlp_layernorm.weight
    decoder.layers.mlp.linear_fc2.weight             <- down_proj
    MoE layers (all layers MoE, Megatron-Core's expert naming, experts stacked after the layers):
    decoder.layers.pre_mlp_layernorm.weight          <- pre_mlp_layernorm.weight (not fused into an MoE layer)
    decoder.layers.mlp.router.weight                 <- mlp.router.weight
    decoder.layers.mlp.experts.experts.linear_fc1.weight  <- [experts.{e}.gate_proj; up_proj], [layers, experts, ...]
    decoder.layers.mlp.experts.experts.linear_fc2.weight  <- experts.{e}.down_proj
    decoder.layers.mlp.shared_experts.linear_fc1/2.weight <- the shared expert, like a dense MLP
    decoder.final_layernorm.weight                   <- final_layernorm.weight
    output_layer.weight                              <- output_layer.weight (absent with tied embeddings)

Exports also hold the `_extra_state` objects megatron-core's layers declare (None), so megatron-core's
`dist_checkpointing.load` with its default strictness takes them; imports find the keys' prefix (NeMo 2.0's
`module.`, or none in a plain megatron-core checkpoint). The local (non-Transformer-Engine) spec's
`input_layernorm.weight` / `pre_mlp_layernorm.weight` names are read too. Both use the rotate-half rotary layout
(`rotary_interleaved=False`), as we do. Checked against megatron-core 0.15.3 and 0.19.2 (their own GPTModel, local
spec, on CPU, and their own `dist_checkpointing`) when installed: `tests/models/test_megatron_core_gpt.py`.
A model mixing dense and MoE layers raises `UnsupportedModelError` before anything is written. The checkpoint's
`context/hf` (its tokenizer, an import's config.json) goes with the weights both ways.
"""

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import save_context
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir, weights_dir
from nemo_ckpt.dist_checkpointing import ShardedObject, ShardedTensor
from nemo_ckpt.models.gpt.convert.checkpoint_io import (
    ConversionOutput,
    check_convertible,
    checkpoint_gpt_config,
    checkpoint_tensor_reader,
)
from nemo_ckpt.models.gpt.convert.hf import copy_artifacts, gpt_shapes, hf_artifact_sources
from nemo_ckpt.models.gpt.lightning import GPTModel
from nemo_ckpt.models.gpt.model import GPTConfig
from nemo_ckpt.models.gpt.moe import moe_layer_pattern

NEMO_PREFIX = "module."
QKV = "decoder.layers.self_attention.linear_qkv.weight"
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
EXPERTS_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
EXPERTS_FC2 = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
SHARED_FC1 = "decoder.layers.mlp.shared_experts.linear_fc1.weight"
DENSE_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
MOE_NORM = "decoder.layers.pre_mlp_layernorm.weight"
# Megatron-Core key (without prefix) -> our per-layer key, for the stacked tensors that map one to one.
_ATTENTION_KEYS = {
    "decoder.layers.self_attention.linear_proj.weight": "self_attention.o_proj.weight",
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
}
_DENSE_MLP_KEYS = {
    DENSE_NORM: "pre_mlp_layernorm.weight",
    "decoder.layers.mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_MOE_KEYS = {MOE_NORM: "pre_mlp_layernorm.weight", "decoder.layers.mlp.router.weight": "mlp.router.weight"}
_SHARED_EXPERT_KEYS = {"decoder.layers.mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight"}
_QK_NORM_KEYS = {
    "decoder.layers.self_attention.q_layernorm.weight": "self_attention.q_layernorm.weight",
    "decoder.layers.self_attention.k_layernorm.weight": "self_attention.k_layernorm.weight",
}
_GLOBAL_KEYS = {
    "embedding.word_embeddings.weight": "module.embedding.weight",
    "decoder.final_layernorm.weight": "module.final_layernorm.weight",
    "output_layer.weight": "module.output_layer.weight",
}
_GLOBAL_KEYS_BY_OURS = {ours: megatron for megatron, ours in _GLOBAL_KEYS.items()}
EMBEDDING = _GLOBAL_KEYS_BY_OURS["module.embedding.weight"]
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj")
DENSE_EXTRA_STATE_MODULES = ("mlp.linear_fc1", "mlp.linear_fc2")
SHARED_EXTRA_STATE_MODULES = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
EXPERT_EXTRA_STATE_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Megatron-Core's `linear_qkv` weight (or bias): q, k and v rows interleaved per query group."""
    groups, head_dim, rest = config.num_query_groups, config.head_dim, q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, head_dim, *rest)
    v = v.reshape(groups, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v weights (or biases) of Megatron-Core's interleaved `linear_qkv` weight (or bias)."""
    groups, head_dim, rest = config.num_query_groups, config.head_dim, qkv.shape[1:]
    q_rows = config.num_attention_heads // groups * head_dim
    grouped = qkv.reshape(groups, q_rows + 2 * head_dim, *rest)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return tuple(part.reshape(-1, *rest).contiguous() for part in (q, k, v))


def unsupported_features(config: GPTConfig, conversion: str) -> list[str]:
    """What of a GPT with `config` Megatron-Core naming cannot express yet: dense and MoE layers mixed."""
    if not config.num_moe_experts or all(moe_layer_pattern(config)):
        return []
    return [
        f"moe_layer_freq={config.moe_layer_freq!r}: dense and MoE layers mixed do not {conversion} yet (all-MoE and "
        "all-dense models do)"
    ]


def is_moe(config: GPTConfig) -> bool:
    """Whether `config`'s layers are MoE layers (Megatron-Core naming converts all-dense or all-MoE models)."""
    return bool(config.num_moe_experts)


def _layer_keys(config: GPTConfig) -> dict[str, str]:
    """Megatron-Core key -> our per-layer key, for the stacked tensors of `config` that map one to one."""
    mlp = _DENSE_MLP_KEYS
    if is_moe(config):
        mlp = _MOE_KEYS | (_SHARED_EXPERT_KEYS if config.moe_shared_expert_intermediate_size else {})
    return _ATTENTION_KEYS | mlp | (_QK_NORM_KEYS if config.qk_layernorm else {})


def _aliases(config: GPTConfig) -> dict[str, str]:
    """Other specs' names of the norms -> the names `_layer_keys` uses (the local spec keeps the norms as modules
    of their own; Transformer Engine fuses a dense MLP's norm into `linear_fc1`, not an MoE layer's)."""
    aliases = {"decoder.layers.input_layernorm.weight": "decoder.layers.self_attention.linear_qkv.layer_norm_weight"}
    if is_moe(config):
        return aliases | {DENSE_NORM: MOE_NORM}
    return aliases | {MOE_NORM: DENSE_NORM}


def _gated(read: Callable[[str], torch.Tensor], mlp: str) -> torch.Tensor:
    """Megatron-Core's SwiGLU `linear_fc1` weight of our MLP at `mlp`: [gate_proj; up_proj]."""
    return torch.cat([read(f"{mlp}.gate_proj.weight"), read(f"{mlp}.up_proj.weight")])


def _fused_mlp(read: Callable[[str], torch.Tensor], prefix: str, config: GPTConfig) -> dict[str, torch.Tensor]:
    """One layer's fused MLP tensors, by Megatron-Core key (experts stacked along a leading expert axis)."""
    if not is_moe(config):
        return {FC1: _gated(read, prefix + "mlp")}
    experts = range(config.num_moe_experts)
    fused = {
        EXPERTS_FC1: torch.stack([_gated(read, f"{prefix}mlp.experts.{e}") for e in experts]),
        EXPERTS_FC2: torch.stack([read(f"{prefix}mlp.experts.{e}.down_proj.weight") for e in experts]),
    }
    if config.moe_shared_expert_intermediate_size:
        fused[SHARED_FC1] = _gated(read, prefix + "mlp.shared_experts")
    return fused


def _split_mlp(state: dict[str, torch.Tensor], layer: int, prefix: str, config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our tensors of one layer's fused MLP tensors (the inverse of `_fused_mlp`)."""
    ours = {}

    def ungate(fc1: torch.Tensor, mlp: str) -> None:
        gate, up = fc1.chunk(2)
        ours[f"{mlp}.gate_proj.weight"], ours[f"{mlp}.up_proj.weight"] = gate.contiguous(), up.contiguous()

    if not is_moe(config):
        ungate(state[FC1][layer], prefix + "mlp")
        return ours
    for expert in range(config.num_moe_experts):
        ungate(state[EXPERTS_FC1][layer][expert], f"{prefix}mlp.experts.{expert}")
        ours[f"{prefix}mlp.experts.{expert}.down_proj.weight"] = state[EXPERTS_FC2][layer][expert]
    if SHARED_FC1 in state:
        ungate(state[SHARED_FC1][layer], prefix + "mlp.shared_experts")
    return ours


def _fused_qkv(read: Callable[[str], torch.Tensor], prefix: str, kind: str, config: GPTConfig) -> torch.Tensor:
    parts = [read(f"{prefix}self_attention.{name}_proj.{kind}") for name in "qkv"]
    return fuse_qkv(*parts, config)


def to_megatron(read: Callable[[str], torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Megatron-Core's GPT state (keys without the `module.` prefix, layers stacked) from our tensors (`read(key)`)."""
    layers = range(config.num_layers)

    def stack(make: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return torch.stack([make(f"module.layers.{i}.") for i in layers])

    state = {QKV: stack(lambda p: _fused_qkv(read, p, "weight", config))}
    mlps = [_fused_mlp(read, f"module.layers.{i}.", config) for i in layers]
    state |= {key: torch.stack([mlp[key] for mlp in mlps]) for key in mlps[0]}
    if config.add_qkv_bias:
        state[QKV_BIAS] = stack(lambda p: _fused_qkv(read, p, "bias", config))
    for megatron_key, ours in _layer_keys(config).items():
        state[megatron_key] = stack(lambda p, ours=ours: read(p + ours))
    for megatron_key, ours in _GLOBAL_KEYS.items():
        if ours != "module.output_layer.weight" or not config.share_embeddings_and_output_weights:
            state[megatron_key] = read(ours)
    return state


def from_megatron(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our GPT tensors from Megatron-Core's GPT state (keys without the `module.` prefix, layers stacked)."""
    aliases = _aliases(config)
    state = {aliases.get(key, key): value for key, value in state.items()}
    layer_keys = _layer_keys(config)
    expected_shapes = megatron_shapes(config)  # no output layer with tied embeddings
    if config.share_embeddings_and_output_weights:
        state.pop("output_layer.weight", None)
    missing, unexpected = sorted(expected_shapes.keys() - state.keys()), sorted(state.keys() - expected_shapes.keys())
    if missing or unexpected:
        raise ValueError(f"Megatron-Core GPT state: missing {missing}, unexpected {unexpected}")
    wrong = [
        f"{key}: {list(state[key].shape)} vs {list(shape)}"
        for key, shape in expected_shapes.items()
        if tuple(state[key].shape) != shape
    ]
    if wrong:
        raise ValueError(
            f"Megatron-Core GPT state does not match the GPTConfig given (stored vs expected): {wrong[:8]}"
        )
    ours = {}
    for megatron_key, key in _GLOBAL_KEYS.items():
        if megatron_key in state:
            ours[key] = state[megatron_key]
    for i in range(config.num_layers):
        prefix = f"module.layers.{i}."
        for fused, kind in ((QKV, "weight"), (QKV_BIAS, "bias")):
            if fused in state:
                for name, part in zip("qkv", split_qkv(state[fused][i], config)):
                    ours[f"{prefix}self_attention.{name}_proj.{kind}"] = part
        ours |= _split_mlp(state, i, prefix, config)
        for megatron_key, key in layer_keys.items():
            ours[prefix + key] = state[megatron_key][i]
    return ours


def megatron_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Megatron-Core key (without prefix) -> shape, for a GPT with `config` (computed on `meta`, no memory)."""
    shapes = gpt_shapes(config)
    state = to_megatron(lambda key: torch.empty(shapes[key], device="meta"), config)
    return {key: tuple(tensor.shape) for key, tensor in state.items()}


def extra_states(prefix: str, config: GPTConfig) -> dict[str, ShardedObject]:
    """The `_extra_state` entries megatron-core's GPT expects of each layer's linear layers (and, with Transformer
    Engine, its core attention), as its `sharded_state_dict` declares them: one object per layer, None here (no FP8
    metadata; both specs load None). Megatron-Core's default strictness refuses a checkpoint without them."""
    modules = EXTRA_STATE_MODULES + (() if is_moe(config) else DENSE_EXTRA_STATE_MODULES)
    if config.moe_shared_expert_intermediate_size:
        modules += SHARED_EXTRA_STATE_MODULES
    layers = config.num_layers
    objects = {
        f"{prefix}decoder.layers.{layer}.{module}._extra_state": ShardedObject(
            f"{prefix}decoder.layers.{module}._extra_state", None, (layers,), (layer,), replica_id=0
        )
        for layer in range(layers)
        for module in modules
    }
    if is_moe(config):  # one per layer and expert
        experts = config.num_moe_experts
        objects |= {
            f"{prefix}decoder.layers.{layer}.{module}.{expert}._extra_state": ShardedObject(
                f"{prefix}decoder.layers.{module}._extra_state", None, (layers, experts), (layer, expert), replica_id=0
            )
            for layer in range(layers)
            for expert in range(experts)
            for module in EXPERT_EXTRA_STATE_MODULES
        }
    return objects


def _save_weights(checkpoint: Path, tensors: dict[str, torch.Tensor], objects: dict[str, ShardedObject]) -> None:
    target = weights_dir(checkpoint)
    target.mkdir(parents=True)
    state = {key: ShardedTensor.from_rank_offsets(key, tensor, replica_id=0) for key, tensor in tensors.items()}
    dist_checkpointing.save({"state_dict": state | objects}, target)


def detect_prefix(keys: list[str], source: Path) -> str:
    """The prefix of the model's keys: NeMo 2.0's `module.`, or none (a plain megatron-core checkpoint)."""
    model_keys = [key for key in keys if not key.startswith("optimizer.")]
    prefixes = [key.removesuffix(EMBEDDING) for key in model_keys if key.endswith(EMBEDDING)]
    if len(prefixes) != 1:
        raise ValueError(
            f"{source} is not a Megatron-Core GPT checkpoint: {len(prefixes)} tensors end in {EMBEDDING!r} (one "
            "expected, under NeMo 2.0's 'module.' prefix or none)"
        )
    return prefixes[0]


def import_megatron(
    source: str | Path,
    output: str | Path,
    config: GPTConfig,
    prefix: str | None = None,
    overwrite: bool = False,
    tokenizer_files: Sequence[Path] = (),
) -> Path:
    """Our checkpoint at `output` from the Megatron-Core / NeMo 2.0 GPT checkpoint `source` (its `weights/`
    directory, or a `dist_checkpointing` directory itself) of a Llama model with `config`. `prefix`: of the model's
    keys (None: detected, NeMo 2.0's `module.` or none). `tokenizer_files`: copied into the output's `context/hf`
    (default: the tokenizer of `source`'s `context/hf`, if it has one)."""
    source = Path(source)
    out = ConversionOutput(Path(output), overwrite)
    conversion = "import from Megatron-Core naming"
    check_convertible(unsupported_features(config, conversion), source, conversion)
    weights = weights_dir(source) if weights_dir(source).is_dir() else source
    metadata = dist_checkpointing.load_tensors_metadata(weights)
    prefix = detect_prefix(list(metadata), source) if prefix is None else prefix
    keys = [key for key in metadata if key.startswith(prefix) and not key.startswith("optimizer.")]
    state = dist_checkpointing.load({key: metadata[key] for key in keys}, weights, validate_access_integrity=False)
    ours = from_megatron({key.removeprefix(prefix): state[key] for key in keys}, config)
    tmp = out.start()
    try:
        _save_weights(tmp, ours, {})
        save_context(tmp, model=GPTModel(config))
        copy_artifacts(*hf_artifact_sources(source), hf_artifacts_dir(tmp))
        for path in tokenizer_files:
            hf_artifacts_dir(tmp).mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, hf_artifacts_dir(tmp) / path.name)
    except BaseException:
        out.abort()
        raise
    return out.commit()


def write_our_context(checkpoint: Path, config: GPTConfig, source: Path, base: Path | None) -> None:
    """Our `context/` in a Megatron-Core export: the model's config and the `context/hf` files of `source` (or of
    its adapter base `base`)."""
    save_context(checkpoint, model=GPTModel(config))
    copy_artifacts(*hf_artifact_sources(source, base=base), hf_artifacts_dir(checkpoint))


def export_megatron(
    checkpoint: str | Path,
    output: str | Path,
    prefix: str = NEMO_PREFIX,
    overwrite: bool = False,
    read_tensor: Callable[[str], torch.Tensor] | None = None,
    base: str | Path | None = None,
    write_context: Callable[[Path, GPTConfig, Path, Path | None], None] = write_our_context,
) -> Path:
    """Our GPT checkpoint written in Megatron-Core's naming (`weights/` with `<prefix>decoder.layers...`), with
    our `context/model.json` and `context/hf` beside it. `read_tensor`: loads one of our tensors by key (default:
    from `checkpoint`'s weights); `base`: an adapter checkpoint's base, whose `context/hf` serves where
    `checkpoint`'s lacks a file; `write_context(output, config, checkpoint, base)`: writes the output's `context/`
    (NeMo 2.0's: `nemo2.write_nemo_context`)."""
    checkpoint = Path(checkpoint)
    out = ConversionOutput(Path(output), overwrite)
    config = checkpoint_gpt_config(checkpoint)
    conversion = "export to Megatron-Core naming"
    check_convertible(unsupported_features(config, conversion), checkpoint, conversion)
    read = read_tensor or checkpoint_tensor_reader(checkpoint)[1]
    state = to_megatron(read, config)
    tmp = out.start()
    try:
        _save_weights(tmp, {prefix + key: tensor for key, tensor in state.items()}, extra_states(prefix, config))
        write_context(tmp, config, checkpoint, None if base is None else Path(base))
    except BaseException:
        out.abort()
        raise
    return out.commit()

"""A Llama-style decoder (RMSNorm, rotary attention, SwiGLU) in plain torch."""

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nemo_ckpt.models.gpt.kv_cache import KVCache, LayerKVCache
from nemo_ckpt.models.gpt.moe import MoELayer, moe_layer_pattern, validate_moe_config
from nemo_ckpt.parallel.context_parallel import ContextParallel

POSITIVE_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length")


@dataclass
class GPTConfig:
    """Model shape, with Megatron-Core's `TransformerConfig` names.

    `vocab_size`: rows of the embedding and output layer; None takes the tokenizer's vocabulary, padded up to a
    multiple of `make_vocab_size_divisible_by` (Megatron's and NeMo's rule), when `pretrain` / `finetune` meet the
    data (`with_vocab_of`). The padding rows are never targets: the tokenizer does not produce their ids.
    `kv_channels`: the width of an attention head (None: hidden_size / num_attention_heads).
    `add_qkv_bias`: biases on the q, k and v projections (Qwen2); `qk_layernorm`: RMSNorm of each query and key
    head before the rotary embedding (Qwen3).
    `rope_scaling`: Llama 3.1's frequency-dependent rotary scaling (`rope_type: "llama3"`): wavelengths longer than
    `rope_original_max_position_embeddings / rope_low_freq_factor` are stretched by `rope_scaling_factor`, those
    shorter than `... / rope_high_freq_factor` kept, those between interpolated.
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int = 172
    vocab_size: int | None = 256
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 32
    kv_channels: int | None = None
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    rotary_base: float = 10000.0
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    share_embeddings_and_output_weights: bool = False
    recompute_granularity: str | None = None
    calculate_per_token_loss: bool = False  # loss summed over tokens / global token count (GPTModel.loss)
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    # mixture of experts (nemo_ckpt/models/gpt/moe.py); dense without num_moe_experts
    num_moe_experts: int | None = None
    moe_layer_freq: int | list[int] = 1
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    moe_shared_expert_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        for name in POSITIVE_SIZES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: use a positive integer")
        validate_moe_config(self)
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(
                f"GPTConfig.make_vocab_size_divisible_by={self.make_vocab_size_divisible_by}: use 1 (no padding) or "
                "more"
            )
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(
                f"GPTConfig.vocab_size={self.vocab_size}: use a positive number, or None (the tokenizer's)"
            )
        if self.recompute_granularity not in (None, "full"):
            raise ValueError(
                f"GPTConfig.recompute_granularity={self.recompute_granularity!r}: use None or 'full' "
                "(recompute every transformer layer in backward)"
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads} "
                "(or set kv_channels, the width of a head)"
            )
        if self.kv_channels is not None and (self.kv_channels < 2 or self.kv_channels % 2):
            raise ValueError(f"GPTConfig.kv_channels={self.kv_channels}: use an even number (rotary pairs)")
        if self.rope_scaling and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"GPTConfig.rope_low_freq_factor={self.rope_low_freq_factor} and rope_high_freq_factor="
                f"{self.rope_high_freq_factor}: use 0 < low < high (Llama 3.1: 1 and 4)"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_query_groups={self.num_query_groups}"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameter count, without building the model."""
        require_vocab_size(self)
        q_dim, kv_dim = self.num_attention_heads * self.head_dim, self.num_query_groups * self.head_dim
        attention = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        attention += (q_dim + 2 * kv_dim) * self.add_qkv_bias + 2 * self.head_dim * self.qk_layernorm
        mlp = 3 * self.hidden_size * self.ffn_hidden_size
        moe_ffn = (self.moe_ffn_hidden_size or self.ffn_hidden_size) * (self.num_moe_experts or 0)
        moe = 3 * self.hidden_size * (moe_ffn + (self.moe_shared_expert_intermediate_size or 0))
        moe += (self.num_moe_experts or 0) * self.hidden_size
        moe_layers = sum(moe_layer_pattern(self))
        layer = attention + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        output = 0 if self.share_embeddings_and_output_weights else embeddings
        mlps = (self.num_layers - moe_layers) * mlp + moe_layers * moe
        return self.num_layers * layer + mlps + embeddings + output + self.hidden_size


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(
        num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=688, vocab_size=1024, seq_length=128
    ),
    "tiny_moe": GPTConfig(num_moe_experts=4, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3),
    "small_moe": GPTConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        ffn_hidden_size=688,
        vocab_size=1024,
        seq_length=128,
        num_moe_experts=8,
        moe_ffn_hidden_size=256,
        moe_shared_expert_intermediate_size=256,
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
    ),
    "llama3_1b": GPTConfig(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=128256,
        seq_length=8192,
        rotary_base=500000.0,
        share_embeddings_and_output_weights=True,
    ),
    "llama3_8b": GPTConfig(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=128256,
        seq_length=8192,
        rotary_base=500000.0,
    ),
}


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """`vocab_size` rounded up to a multiple of `divisible_by` (Megatron's `make_vocab_size_divisible_by`)."""
    if divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by={divisible_by}: use 1 (no padding) or more")
    return -(-vocab_size // divisible_by) * divisible_by


class VocabularyError(ValueError):
    """A model whose vocabulary cannot hold the ids the data holds."""


def with_vocab_of(config: GPTConfig, data_vocab_size: int, source: str) -> GPTConfig:
    """`config` with its `vocab_size` for data of `data_vocab_size` ids (`source` names where they come from, e.g.
    "the tokenizer byte-level"): None becomes that size padded to `make_vocab_size_divisible_by`; a set size must be
    at least that large (`VocabularyError` otherwise, naming both numbers and the fix)."""
    padded = padded_vocab_size(data_vocab_size, config.make_vocab_size_divisible_by)
    if config.vocab_size is None:
        return replace(config, vocab_size=padded)
    if config.vocab_size < data_vocab_size:
        raise VocabularyError(
            f"model.config.vocab_size={config.vocab_size} is smaller than the {data_vocab_size} token ids of "
            f"{source}: ids from {config.vocab_size} up would index past the embedding. Set "
            f"model.config.vocab_size=None to take the tokenizer's ({padded}, padded to a multiple of "
            f"make_vocab_size_divisible_by={config.make_vocab_size_divisible_by}), or a size >= {data_vocab_size}"
        )
    return config


def require_vocab_size(config: GPTConfig) -> int:
    """The config's `vocab_size`; a clear error while it is still None (to be taken from the tokenizer)."""
    if config.vocab_size is None:
        raise VocabularyError(
            "GPTConfig.vocab_size=None is taken from the tokenizer when pretrain/finetune meet the data; to build "
            "the model on its own, set vocab_size (or apply nemo_ckpt.models.gpt.model.with_vocab_of first)"
        )
    return config.vocab_size


def gpt_config(size: str = "tiny", **overrides) -> GPTConfig:
    """A preset (`tiny`, `small`, `tiny_moe`, `small_moe`, `llama3_1b`, `llama3_8b`) with field overrides."""
    if size not in PRESETS:
        raise ValueError(f"Unknown model size {size!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[size], **overrides)


class Linear(nn.Linear):
    """A linear layer (bias-free unless `bias`) whose `reset_parameters` is Megatron's init: weight normal(0,
    `init_std`), bias zero."""

    def __init__(self, in_features: int, out_features: int, init_std: float, bias: bool = False) -> None:
        self.init_std = init_std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """An embedding whose `reset_parameters` is Megatron's normal(0, `init_std`) init."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float) -> None:
        self.init_std = init_std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


def output_init_std(config: GPTConfig) -> float:
    """Megatron's init std of the projections into the residual stream (o_proj, down_proj)."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)


def rotary_frequencies(config: GPTConfig, device: torch.device | None = None) -> torch.Tensor:
    """The rotary embedding's inverse frequencies [head_dim / 2], with Llama 3.1's scaling (`rope_scaling`)."""
    inv_freq = 1.0 / config.rotary_base ** (
        torch.arange(0, config.head_dim, 2, device=device).float() / config.head_dim
    )
    if not config.rope_scaling:
        return inv_freq
    factor, original = config.rope_scaling_factor, config.rope_original_max_position_embeddings
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(config: GPTConfig, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles at `position_ids` (global positions): [seq] gives [seq, head_dim / 2],
    [batch, seq] (a data set's per-sample positions) gives [batch, 1, seq, head_dim / 2], broadcast over heads."""
    inv_freq = rotary_frequencies(config, position_ids.device)
    angles = position_ids.float().unsqueeze(-1) * inv_freq
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)
    return angles.cos(), angles.sin()


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """The boolean attention mask [batch, 1, seq, seq] of packed sequences: query t attends to key s <= t of its
    own segment (`segment_ids` [batch, seq], one id per sample of a row), so samples never see each other."""
    seq = segment_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segment_ids.device).tril()
    same_segment = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    return (same_segment & causal).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped queries; with `context_parallel` set (by
    `GPTModel.parallelize_context`), the sequence is split over cp ranks and attention runs as a ring."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.context_parallel: ContextParallel | None = None
        q_dim, kv_dim = config.num_attention_heads * config.head_dim, config.num_query_groups * config.head_dim
        std, bias = config.init_method_std, config.add_qkv_bias
        self.q_proj = Linear(config.hidden_size, q_dim, std, bias)
        self.k_proj = Linear(config.hidden_size, kv_dim, std, bias)
        self.v_proj = Linear(config.hidden_size, kv_dim, std, bias)
        self.o_proj = Linear(q_dim, config.hidden_size, output_init_std(config))
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = nn.RMSNorm(config.head_dim, eps=config.layernorm_epsilon)
            self.k_layernorm = nn.RMSNorm(config.head_dim, eps=config.layernorm_epsilon)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """`mask`: None for plain causal attention, or a boolean [batch, 1, seq, keys] mask (True: may attend) of
        packed sequences (`packed_attention_mask`) or of a `KVCache`. `kv_cache`: the keys and values of earlier
        tokens, which the new ones are appended to and attend over (incremental decoding)."""
        batch, seq, _ = x.shape
        head_dim = self.config.head_dim
        q = self.q_proj(x).view(batch, seq, -1, head_dim)
        k = self.k_proj(x).view(batch, seq, -1, head_dim)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        if self.context_parallel is not None:
            if mask is not None:
                raise ValueError(
                    "packed sequences (segment_ids) are not supported with context parallelism: use "
                    "context_parallel_size=1, or FineTuningDataModule(packed_sequence_specs=None)"
                )
            out = self.context_parallel.attention(q, k, v, causal=True)
        elif mask is None:  # causal; a single query (a decode step) attends to every key
            out = F.scaled_dot_product_attention(q, k, v, is_causal=seq > 1, enable_gqa=q.shape[1] != k.shape[1])
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, ffn_hidden_size: int | None = None) -> None:
        super().__init__()
        std = config.init_method_std
        ffn_hidden_size = ffn_hidden_size or config.ffn_hidden_size
        self.gate_proj = Linear(config.hidden_size, ffn_hidden_size, std)
        self.up_proj = Linear(config.hidden_size, ffn_hidden_size, std)
        self.down_proj = Linear(ffn_hidden_size, config.hidden_size, output_init_std(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    """`layer_number`: the layer's global index, which decides between a dense MLP and a `MoELayer`
    (`moe_layer_freq`)."""

    def __init__(self, config: GPTConfig, layer_number: int = 0) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = Attention(config)
        self.pre_mlp_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        if moe_layer_pattern(config)[layer_number]:
            self.mlp = MoELayer(config, lambda ffn_hidden_size: MLP(config, ffn_hidden_size))
        else:
            self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin, mask=mask, kv_cache=kv_cache)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class LayerDict(nn.ModuleDict):
    """Transformer layers keyed by their global index (`layers.{i}` in checkpoints, whichever layers a pipeline
    stage holds); indexable by int and iterated in index order like a `ModuleList`."""

    def __init__(self, layers: dict[int, nn.Module] | None = None) -> None:
        super().__init__({str(index): layer for index, layer in sorted((layers or {}).items())})

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.values())

    def indices(self) -> list[int]:
        """The global indices of the layers held, ascending."""
        return [int(key) for key in self.keys()]


class GPT(nn.Module):
    """Decoder-only language model: token ids [batch, seq] -> logits [batch, seq, vocab].

    A pipeline stage is a GPT holding some of the layers (`layers` keyed by global index): without
    `pre_process` it takes hidden states instead of token ids, without `post_process` it returns hidden states
    (Megatron-Core's names). `sequence_parallel_size`: how many ranks the hidden states' sequence dimension is
    split over between layers (sequence parallelism), so a stage taking hidden states knows the full length.
    """

    fsdp_unit_modules = (TransformerLayer, Embedding)  # FSDP2 shards and gathers each of these as one unit

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.pre_process = True
        self.post_process = True
        self.sequence_parallel_size = 1
        vocab_size = require_vocab_size(config)
        self.embedding = Embedding(vocab_size, config.hidden_size, config.init_method_std)
        self.layers = LayerDict({index: TransformerLayer(config, index) for index in range(config.num_layers)})
        self.final_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.output_layer = None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = Linear(config.hidden_size, vocab_size, config.init_method_std)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron's init: normal(std) weights, output projections scaled by 1/sqrt(2 * layers).

        Each submodule initializes its own parameters when built and in `reset_parameters`, in module order, so
        a model built eagerly, re-initialized, or built on `meta` and materialized module by module
        (`to_empty` + `reset_parameters`) from the same random state gets the same values.
        """
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """`tokens`: token ids [batch, seq] (hidden states [batch, seq, hidden] without `pre_process`);
        `position_ids` ([seq] or [batch, seq]): the global positions of their columns (default 0..seq-1);
        `segment_ids` [batch, seq]: packed sequences, the sample each token belongs to (attention stays within a
        sample, `packed_attention_mask`); None: one causal sequence per row.
        `kv_cache` (`nemo_ckpt.models.gpt.kv_cache.KVCache`): the tokens follow those it holds, attend over them,
        and are added to it (generation); pass their `position_ids`."""
        if position_ids is None:
            seq_length = tokens.shape[1] * (1 if self.pre_process else self.sequence_parallel_size)
            position_ids = torch.arange(seq_length, device=tokens.device)
        cos, sin = rotary_tables(self.config, position_ids)
        mask = None if segment_ids is None else packed_attention_mask(segment_ids)
        x = self.embedding(tokens) if self.pre_process else tokens
        if kv_cache is not None:
            x = self._forward_cached(x, cos, sin, kv_cache)
        else:
            for layer in self.layers:
                if self.config.recompute_granularity == "full" and torch.is_grad_enabled():
                    x = checkpoint(layer, x, cos, sin, mask=mask, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, mask=mask)
        if not self.post_process:
            return x
        x = self.final_layernorm(x)
        if self.output_layer is None:
            return F.linear(x, self.embedding.weight)
        return self.output_layer(x)

    def _forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """The layers over `x` (the tokens after those `kv_cache` holds), each with its cache; advances it."""
        seq = x.shape[1]
        mask = kv_cache.attention_mask(seq, x.device)
        for index, layer in zip(self.layers.indices(), self.layers):
            x = layer(x, cos, sin, mask=mask, kv_cache=kv_cache.layer(index))
        kv_cache.advance(seq)
        return x

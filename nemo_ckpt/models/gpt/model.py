"""A Llama-style decoder (RMSNorm, rotary attention, SwiGLU) in plain torch."""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    """Model shape, with Megatron-Core's `TransformerConfig` names."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int = 172
    vocab_size: int = 256
    seq_length: int = 32
    rotary_base: float = 10000.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    share_embeddings_and_output_weights: bool = False
    recompute_granularity: str | None = None

    def __post_init__(self) -> None:
        if self.recompute_granularity not in (None, "full"):
            raise ValueError(
                f"GPTConfig.recompute_granularity={self.recompute_granularity!r}: use None or 'full' "
                "(recompute every transformer layer in backward)"
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_query_groups={self.num_query_groups}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameter count, without building the model."""
        kv_dim = self.num_query_groups * self.head_dim
        attention = self.hidden_size * (self.hidden_size + 2 * kv_dim) + self.hidden_size**2
        mlp = 3 * self.hidden_size * self.ffn_hidden_size
        layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        output = 0 if self.share_embeddings_and_output_weights else embeddings
        return self.num_layers * layer + embeddings + output + self.hidden_size


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(
        num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=688, vocab_size=1024, seq_length=128
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


def gpt_config(size: str = "tiny", **overrides) -> GPTConfig:
    """A preset (`tiny`, `small`, `llama3_1b`, `llama3_8b`) with field overrides."""
    if size not in PRESETS:
        raise ValueError(f"Unknown model size {size!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[size], **overrides)


class Linear(nn.Linear):
    """A bias-free linear layer whose `reset_parameters` is Megatron's normal(0, `init_std`) init."""

    def __init__(self, in_features: int, out_features: int, init_std: float) -> None:
        self.init_std = init_std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


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


def rotary_tables(config: GPTConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / config.rotary_base ** (
        torch.arange(0, config.head_dim, 2, device=device).float() / config.head_dim
    )
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        kv_dim = config.num_query_groups * config.head_dim
        std = config.init_method_std
        self.q_proj = Linear(config.hidden_size, config.hidden_size, std)
        self.k_proj = Linear(config.hidden_size, kv_dim, std)
        self.v_proj = Linear(config.hidden_size, kv_dim, std)
        self.o_proj = Linear(config.hidden_size, config.hidden_size, output_init_std(config))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        head_dim = self.config.head_dim
        q = self.q_proj(x).view(batch, seq, -1, head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        std = config.init_method_std
        self.gate_proj = Linear(config.hidden_size, config.ffn_hidden_size, std)
        self.up_proj = Linear(config.hidden_size, config.ffn_hidden_size, std)
        self.down_proj = Linear(config.ffn_hidden_size, config.hidden_size, output_init_std(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.self_attention = Attention(config)
        self.pre_mlp_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPT(nn.Module):
    """Decoder-only language model: token ids [batch, seq] -> logits [batch, seq, vocab]."""

    fsdp_unit_modules = (TransformerLayer, Embedding)  # FSDP2 shards and gathers each of these as one unit

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config.vocab_size, config.hidden_size, config.init_method_std)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.RMSNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.output_layer = None
        if not config.share_embeddings_and_output_weights:
            self.output_layer = Linear(config.hidden_size, config.vocab_size, config.init_method_std)

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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(self.config, tokens.shape[1], tokens.device)
        x = self.embedding(tokens)
        for layer in self.layers:
            if self.config.recompute_granularity == "full" and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        x = self.final_layernorm(x)
        if self.output_layer is None:
            return F.linear(x, self.embedding.weight)
        return self.output_layer(x)

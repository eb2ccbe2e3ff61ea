"""The key/value cache of incremental decoding: each attention layer's keys and values of the tokens seen so far,
in buffers preallocated for `max_length` positions, so a decode step computes attention for its new tokens only.

Buffers take their shape from the first keys written ([batch, groups, max_length, head_dim]), so an attention
layer holding only its local heads (tensor parallelism) caches those. `padding` ([batch, max_length], True where a
token is real) marks the left padding of prompts of different lengths: attention never sees a padding token.
"""

import torch


class LayerKVCache:
    """One attention layer's keys and values, written at the cache's current position."""

    def __init__(self, cache: "KVCache") -> None:
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `keys`/`values` [batch, groups, seq, head_dim] of the new tokens; return those of every token so
        far, [batch, groups, length + seq, head_dim]."""
        start = self.cache.length
        end = start + keys.shape[2]
        if end > self.cache.max_length:
            raise ValueError(f"KVCache(max_length={self.cache.max_length}) cannot hold {end} positions")
        if self.keys is None:
            shape = (*keys.shape[:2], self.cache.max_length, keys.shape[3])
            self.keys = keys.new_zeros(shape)
            self.values = values.new_zeros(shape)
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every layer's `LayerKVCache` (by global layer index) and the number of positions they hold (`length`).

    `GPT.forward(..., kv_cache=cache)` reads and extends it, then advances `length` by the tokens it was given.
    """

    def __init__(self, max_length: int, padding: torch.Tensor | None = None) -> None:
        if padding is not None and padding.shape[-1] != max_length:
            raise ValueError(f"KVCache padding of {padding.shape[-1]} positions for max_length={max_length}")
        self.max_length = max_length
        self.padding = padding
        self.length = 0
        self.layers: dict[int, LayerKVCache] = {}

    def layer(self, index: int) -> LayerKVCache:
        """The cache of layer `index` (created on first use)."""
        if index not in self.layers:
            self.layers[index] = LayerKVCache(self)
        return self.layers[index]

    def attention_mask(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """The boolean mask (True: may attend) of `seq` new queries over every key so far: None where causal
        attention needs none (no padding, and a first chunk or a single new token), else [seq, keys] or, with
        padding, [batch, 1, seq, keys]. A padding query attends to itself only, so its row stays finite."""
        start, end = self.length, self.length + seq
        if self.padding is None and (start == 0 or seq == 1):
            return None
        keys = torch.arange(end, device=device)
        queries = torch.arange(start, end, device=device).unsqueeze(-1)
        causal = keys <= queries
        if self.padding is None:
            return causal
        visible = self.padding[:, None, :end].to(device) | (keys == queries)
        return (causal & visible).unsqueeze(1)

    def advance(self, seq: int) -> None:
        """Count `seq` more positions as held (after every layer wrote them)."""
        self.length += seq

"""`SamplingParams`: how tokens are chosen and when generation stops; `sample`: the next token of each row."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Generation options (transformers' `generate` names).

    `temperature` 0 is greedy (the most likely token); above 0 tokens are sampled from the softmax of logits /
    temperature, restricted to the `top_k` most likely (0: all) and to the smallest set whose probability reaches
    `top_p` (1.0: all); `seed` makes sampling repeat (None: a fresh random seed). A row stops after
    `max_new_tokens`, or at one of `stop_token_ids` (not part of the output), or once its text holds one of
    `stop_strings` (the text is cut before it; text generation only, `nemo_ckpt.inference.text`).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: use a positive integer")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r}: use 0 (greedy) or more")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: use 0 (off) or a positive integer")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: use a probability in (0, 1] (1.0: off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed={self.seed!r}: use an integer or None")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any(isinstance(token, bool) or not isinstance(token, int) or token < 0 for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: use token ids (non-negative integers)")
        if any(not isinstance(text, str) or not text for text in self.stop_strings):
            raise ValueError(f"stop_strings={self.stop_strings!r}: use non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The random generator of sampling (None for greedy), seeded with `params.seed` when it is set."""
    if params.greedy:
        return None
    generator = torch.Generator(device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The next token [batch] from each row of `logits` [batch, vocab]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= params.top_p  # the mass before the token already reaches top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(beyond, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)

"""The generation engine: a prefill of the prompts, then one decode step per new token over the KV cache.

Prompts of different lengths go in one batch left-padded: padding tokens are masked out of attention (the
cache's `padding`) and each row's positions start at 0 at its first real token, so every row generates what it
would alone.
"""

from collections.abc import Callable

import torch
from torch import nn

from nemo_ckpt.inference.parallel import PipelineForward
from nemo_ckpt.inference.sampling import SamplingParams, make_generator, sample
from nemo_ckpt.models.gpt.kv_cache import KVCache
from nemo_ckpt.models.gpt.model import GPT

OnToken = Callable[[int, int], bool]  # (row, token) -> whether the row stops there
Forward = Callable[[torch.Tensor, torch.Tensor, KVCache], torch.Tensor]  # tokens, positions, cache -> last logits


def model_forward(model: nn.Module) -> tuple[GPT, Forward]:
    """The `GPT` (this rank's stage, under pipeline parallelism) of `model`, a `GPT` or a built `GPTModel`, and the
    function giving the logits of each row's last new token (`PipelineForward` across pipeline stages)."""
    if getattr(model, "pipeline_stages", None):
        forward = PipelineForward(model)
        return forward.stage, forward
    gpt = getattr(model, "module", model)
    if not isinstance(gpt, GPT):
        raise TypeError(f"generate takes a GPT or a GPTModel with its module built, not {type(model).__name__}")
    return gpt, lambda tokens, positions, kv_cache: gpt(tokens, positions, kv_cache=kv_cache)[:, -1]


def check_prompts(prompts: list[list[int]], params: SamplingParams, gpt: GPT) -> None:
    """Named errors for prompts the model cannot continue: none, an empty one, ids outside the vocabulary, or
    too long for the model's positions (`seq_length`) with `max_new_tokens` more."""
    if not prompts:
        raise ValueError("prompts=[]: give at least one prompt")
    vocab_size = gpt.config.vocab_size
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{row}] is empty: a prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompts[{row}] holds token ids outside the model's vocabulary [0, {vocab_size})")
    longest = max(len(prompt) for prompt in prompts)
    if longest + params.max_new_tokens > gpt.config.seq_length:
        raise ValueError(
            f"a prompt of {longest} tokens and max_new_tokens={params.max_new_tokens} exceed the model's "
            f"seq_length={gpt.config.seq_length} positions: shorten the prompt or lower max_new_tokens"
        )


def left_padded(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch [batch, longest], left-padded with 0, and how much padding each row has."""
    longest = max(len(prompt) for prompt in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt)
    pads = torch.tensor([longest - len(prompt) for prompt in prompts])
    return tokens.to(device), pads.to(device)


@torch.inference_mode()
def generate_tokens(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingParams,
    on_token: OnToken | None = None,
    compiled: bool = False,
) -> list[list[int]]:
    """The new token ids of each prompt (token ids), generated with `params`; a stop token ends its row and is
    not included. `on_token(row, token)` sees every token kept as it is produced (streaming) and may end the row
    by returning True (that token stays included). `model`: a `GPT` or a `GPTModel`, whole or this rank's part
    (`load_parallel_model`; every rank then calls this with the same prompts and parameters). `compiled`: decode
    steps through `torch.compile` (dynamic shapes: one graph for every cache length; the GPU path, where it
    saves kernel launches and Python time per token; the first steps compile)."""
    gpt, forward = model_forward(model)
    check_prompts(prompts, params, gpt)
    device = next(gpt.parameters()).device
    tokens, pads = left_padded(prompts, device)
    batch, longest = tokens.shape
    max_length = longest + params.max_new_tokens
    padding = None
    positions: torch.Tensor = torch.arange(longest, device=device)
    if bool(pads.any()):
        padding = torch.arange(max_length, device=device) >= pads.unsqueeze(-1)
        positions = (positions - pads.unsqueeze(-1)).clamp(min=0)
    cache = KVCache(max_length, padding)
    generator = make_generator(params, device)
    stops = set(params.stop_token_ids)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    running = [True] * batch
    decode = torch.compile(forward, dynamic=True) if compiled else forward
    logits = forward(tokens, positions, cache)
    next_positions = positions[..., -1:] + 1
    for step in range(params.max_new_tokens):
        chosen = sample(logits, params, generator)
        for row, token in enumerate(chosen.tolist()):
            if not running[row]:
                continue
            if token in stops:
                running[row] = False
                continue
            outputs[row].append(token)
            if on_token is not None and on_token(row, token):
                running[row] = False
        if not any(running) or step + 1 == params.max_new_tokens:
            break
        logits = decode(chosen.unsqueeze(-1), next_positions, cache)
        next_positions = next_positions + 1
    return outputs

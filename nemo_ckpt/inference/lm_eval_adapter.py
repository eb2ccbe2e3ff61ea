"""lm-evaluation-harness on a checkpoint: `CheckpointLM`, lm_eval's `LM` (loglikelihood, loglikelihood_rolling,
generate_until) over the model `load_model` rebuilds, with the `eval` extra (`pip install -e '.[eval]'`).

It tokenizes with the checkpoint's tokenizer (`context/hf`, through transformers' `AutoTokenizer`) and scores over
the vocabulary of the checkpoint's Hugging Face export (an import's padding rows left out), as lm_eval's Hugging Face
backend (`HFLM`) does on that export, so both give the same results
(`tests/inference/test_lm_eval_adapter.py`):

    import lm_eval
    from nemo_ckpt.inference.lm_eval_adapter import CheckpointLM

    results = lm_eval.simple_evaluate(model=CheckpointLM("runs/tiny/checkpoints/...-last"), tasks=[...])

Importing this module registers it as lm_eval's model `nemo_ckpt` (`model="nemo_ckpt", model_args="path=..."`).
"""

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from transformers import AutoTokenizer

from nemo_ckpt.checkpoint.context import load_model
from nemo_ckpt.inference.generate import generate_tokens
from nemo_ckpt.inference.sampling import SamplingParams
from nemo_ckpt.models.gpt.convert.hf import hf_artifact_sources
from nemo_ckpt.models.gpt.lightning import GPTModel

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)
SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "top_p"}


@register_model("nemo_ckpt")
class CheckpointLM(LM):
    """lm_eval's `LM` over checkpoint `path` (a LoRA adapter checkpoint: base + adapters).

    `batch_size`: sequences per forward; `max_length`: the longest input (default: the model's `seq_length`, the
    export's `max_position_embeddings`); `max_gen_toks`: generate_until's default number of new tokens;
    `add_bos_token`, `prefix_token_id`: as `HFLM`'s (None: the tokenizer's default; its bos, else its eos);
    `device`: default CUDA when available. Runs in float32, in one process.
    """

    def __init__(
        self,
        path: str,
        batch_size: int = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        device: str | None = None,
        trust_code: bool = False,
    ) -> None:
        super().__init__()
        model = load_model(path, trust_code=trust_code)
        if not isinstance(model, GPTModel):
            raise ValueError(f"{path} holds a {type(model).__name__}; CheckpointLM takes GPTModel checkpoints")
        config_dir, tokenizer_dir = hf_artifact_sources(Path(path), base=getattr(model.peft, "base_checkpoint", None))
        if tokenizer_dir is None:
            raise FileNotFoundError(f"{path} stores no tokenizer (context/hf): lm_eval's requests are text")
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        self.model = model.float().eval().to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # the export's vocabulary: an imported model's own (config.json), else ours with its padding rows
        exported = json.loads((config_dir / "config.json").read_text())["vocab_size"] if config_dir else None
        self.vocab_size = int(exported or model.config.vocab_size)
        self.max_length = int(max_length or model.config.seq_length)
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.eot_token_id = int(self.tokenizer.eos_token_id)
        default_prefix = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id
        self.prefix_token_id = int(default_prefix if prefix_token_id is None else prefix_token_id)
        if self.max_length > model.config.seq_length:
            raise ValueError(f"max_length={self.max_length} exceeds the model's seq_length={model.config.seq_length}")

    @property
    def device(self) -> torch.device:
        return self.model.device

    def tok_encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """`text`'s ids as `HFLM.tok_encode` gives them: special tokens per `add_special_tokens`, else
        `add_bos_token`, else the tokenizer's default, but none added to text that starts with the prefix token."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
            if text.startswith(self.tokenizer.decode(self.prefix_token_id)):
                add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(text, **options)

    def encode_pair(self, context: str, continuation: str) -> Pair:
        """lm_eval's split of a request (`TemplateLM.loglikelihood`): an empty context is the prefix token; trailing
        spaces of the context go to the continuation; the continuation is what the whole adds to the context."""
        if not context:
            ids = self.tok_encode(continuation, add_special_tokens=False)
            return ([self.prefix_token_id], ids) if ids[0] != self.prefix_token_id else (ids[:1], ids[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, context_ids = self.tok_encode(context + continuation), self.tok_encode(context)
        return context_ids, whole[len(context_ids) :]

    def batches(self, count: int, key: Callable[[int], int]) -> Iterator[list[int]]:
        """The indices of `count` requests in batches of `batch_size`, longest (by `key`) first."""
        order = sorted(range(count), key=key, reverse=True)
        for start in range(0, count, self.batch_size):
            yield order[start : start + self.batch_size]

    @torch.no_grad()
    def score(self, pairs: Sequence[Pair]) -> list[tuple[float, bool]]:
        """Each continuation's log-probability after its context, and whether greedy decoding gives it; inputs
        longer than `max_length` lose their oldest tokens (as `HFLM`'s)."""
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        for batch in self.batches(len(pairs), key=lambda i: len(pairs[i][0]) + len(pairs[i][1])):
            inputs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1) :][:-1] for i in batch]
            tokens = torch.zeros(len(batch), max(map(len, inputs)), dtype=torch.long)
            for row, ids in enumerate(inputs):
                tokens[row, : len(ids)] = torch.tensor(ids)  # right padding: causal attention never sees it
            logprobs = F.log_softmax(self.model(tokens.to(self.device))[..., : self.vocab_size].float(), dim=-1)
            for row, (index, ids) in enumerate(zip(batch, inputs)):
                continuation = torch.tensor(pairs[index][1], device=self.device)
                scored = logprobs[row, len(ids) - len(continuation) : len(ids)]
                greedy = bool((scored.argmax(-1) == continuation).all())
                results[index] = (float(scored.gather(-1, continuation[:, None]).sum()), greedy)
        return results

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(*request.args) for request in requests])

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        """Each text's log-likelihood in disjoint windows of `max_length` tokens, each with as much context as fits
        (`get_rolling_token_windows`, context_len=1, as `HFLM`), the first after the prefix token."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            ids = self.tok_encode(request.args[0])
            for window in get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score(windows)):
            totals[owner] += logprob
        return totals

    def prompt_ids(self, context: str, max_ids: int) -> list[int]:
        """A generation prompt's last `max_ids` ids, encoded as `HFLM.tok_batch_encode` does."""
        bos = self.tokenizer.bos_token
        add_special_tokens = False if bos is not None and context.startswith(bos) else self.add_bos_token
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(context, **options)[-max_ids:]

    def sampling_params(self, gen_kwargs: dict[str, Any]) -> tuple[SamplingParams, list[str]]:
        """A request's generation options as `SamplingParams` (greedy unless `do_sample`) and its stop strings (the
        eos text among them, as `HFLM`)."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        if max_gen_toks >= self.max_length:
            raise ValueError(
                f"generate_until: max_gen_toks={max_gen_toks} leaves no room for a context in "
                f"max_length={self.max_length}"
            )
        unsupported = sorted(set(kwargs) - SAMPLING_KEYS)
        if unsupported:
            raise ValueError(f"generate_until: generation options {unsupported} are not supported here")
        sampled = bool(kwargs.get("do_sample"))
        params = SamplingParams(
            max_new_tokens=max_gen_toks,
            temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
            top_k=int(kwargs.get("top_k") or 0),
            top_p=float(kwargs.get("top_p") or 1.0),
            stop_token_ids=(self.eot_token_id,),
        )
        return params, until

    def generate(self, prompts: list[list[int]], params: SamplingParams, until: list[str]) -> list[str]:
        """The texts generated after `prompts` (one batch), each cut before its first stop string; a row stops
        generating once its text holds one (`generate_tokens`' `on_token`)."""
        generated: list[list[int]] = [[] for _ in prompts]

        def stops(row: int, token: int) -> bool:
            generated[row].append(token)
            text = self.tokenizer.decode(generated[row], skip_special_tokens=True)
            return any(stop and stop in text for stop in until)

        outputs = generate_tokens(self.model, prompts, params, on_token=stops)
        texts = (self.tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs)
        return [postprocess_generated_text(text, until, None) for text in texts]

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Each context's continuation, greedy unless the request samples, until a stop string or `max_gen_toks`
        (the request's, else this LM's); requests with the same options go in batches of `batch_size`."""
        results = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        for indices in groups.values():
            params, until = self.sampling_params(requests[indices[0]].args[1])
            prompts = {
                i: self.prompt_ids(requests[i].args[0], self.max_length - params.max_new_tokens) for i in indices
            }
            for batch in self.batches(len(indices), key=lambda k: len(prompts[indices[k]])):
                members = [indices[k] for k in batch]
                for index, text in zip(members, self.generate([prompts[i] for i in members], params, until)):
                    results[index] = text
        return results

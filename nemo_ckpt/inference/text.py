"""Text in and out of the engine: a checkpoint's tokenizer (its `context/hf` files, through transformers'
`AutoTokenizer`), prompts encoded plainly or with the tokenizer's chat template, the tokens that end generation
(the tokenizer's and the generation config's eos), and streamed text cut at stop strings."""

import json
from pathlib import Path
from typing import Any, TextIO

from nemo_ckpt.checkpoint.hf_tokenizer import has_tokenizer
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir
from nemo_ckpt.inference.generate import generate_tokens
from nemo_ckpt.inference.sampling import SamplingParams


def load_tokenizer(checkpoint: str | Path) -> Any:
    """The Hugging Face tokenizer `checkpoint` stores in `context/hf`."""
    directory = hf_artifacts_dir(checkpoint)
    if not has_tokenizer(directory):
        raise FileNotFoundError(
            f"{checkpoint} stores no tokenizer ({directory} holds no tokenizer.json or tokenizer.model): generate "
            "token ids with nemo_ckpt.inference.generate.generate_tokens instead"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError("generating text needs transformers: pip install 'nemo-ckpt[hf]'") from error
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def encode_prompts(tokenizer: Any, prompts: list[str], chat: bool = False) -> list[list[int]]:
    """The token ids of each prompt: as the tokenizer encodes text (its special tokens, e.g. BOS, included), or
    with `chat` as a user turn through the tokenizer's chat template, with the assistant's turn opened."""
    if not chat:
        return [tokenizer(prompt).input_ids for prompt in prompts]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat=True: the checkpoint's tokenizer has no chat_template (context/hf/tokenizer_config.json or "
            "chat_template.jinja); use chat=False for plain text prompts"
        )
    turns = [[{"role": "user", "content": prompt}] for prompt in prompts]
    texts = [tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False) for turn in turns]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]  # the template has its BOS


def end_token_ids(tokenizer: Any, checkpoint: str | Path) -> tuple[int, ...]:
    """The tokens that end a generation: the tokenizer's eos, and those of the checkpoint's
    `generation_config.json` (an imported model's, e.g. Llama 3's end-of-turn)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = hf_artifacts_dir(checkpoint) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))


class TextStream:
    """One row's generated text, grown token by token: `push` returns the text that became final (a character
    still incomplete in UTF-8, or what could start a stop string, waits), `stopped` says a stop string was met
    (the text ends before it)."""

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [self.text.find(stop) for stop in self.stop_strings if stop in self.text]
        if cuts:
            self.text, self.stopped = self.text[: min(cuts)], True
            return self.flush()
        if self.text.endswith("\ufffd"):  # a character whose bytes have not all come yet
            return ""
        held = max((len(stop) - 1 for stop in self.stop_strings), default=0)
        return self._emit(len(self.text) - held)

    def flush(self) -> str:
        """The rest of the text (at the end of generation)."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        new, self.emitted = self.text[self.emitted : end], end
        return new


def generate_text(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    params: SamplingParams,
    chat: bool = False,
    stream: bool = False,
    out: TextIO | None = None,
) -> list[str]:
    """The text generated after each prompt, cut at `params.stop_strings`. With `stream`, the prompts go one at
    a time, their text written to `out` (where given) as it is produced (a line `[i] <prompt>` before each, a
    newline after); without, in one batch (the same text: each row generates what it would alone)."""
    out = out if stream else None
    if not prompts:
        raise ValueError("prompts=[]: give at least one prompt")
    ids = encode_prompts(tokenizer, prompts, chat)
    texts = []
    for batch in [[row] for row in range(len(ids))] if stream else [list(range(len(ids)))]:
        streams = [TextStream(tokenizer, params.stop_strings) for _ in batch]

        def on_token(row: int, token: int, streams: list[TextStream] = streams) -> bool:
            new = streams[row].push(token)
            if out is not None and new:
                out.write(new)
                out.flush()
            return streams[row].stopped

        if out is not None:
            out.write(f"[{batch[0]}] {prompts[batch[0]]}\n")
        generate_tokens(model, [ids[row] for row in batch], params, on_token=on_token)
        for text_stream in streams:
            rest = text_stream.flush()
            if out is not None:
                out.write(rest + "\n")
                out.flush()
            texts.append(text_stream.text)
    return texts

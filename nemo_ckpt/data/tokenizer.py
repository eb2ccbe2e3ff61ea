"""Tokenizers from local files, in NeMo's and Megatron-LM's style: `get_tokenizer(name_or_path)`,
`get_nmt_tokenizer(library, ...)` and `build_tokenizer(tokenizer_type, ...)` (Megatron-LM's `--tokenizer-type`).

- `ByteLevelTokenizer`: UTF-8 bytes, no files (ids 0-255, then the end-of-document token).
- `HFTokenizer`: a Hugging Face fast tokenizer from a local directory or `tokenizer.json`
  (`AutoTokenizer.from_pretrained` when transformers is installed, else `tokenizers.Tokenizer.from_file`).
- `GPT2BPETokenizer`: GPT-2's byte-level BPE from `vocab.json` + `merges.txt`, `<|endoftext|>` ending documents.
- `SentencePieceTokenizer`: a `.model` file (needs the `sentencepiece` package).
- `train_bpe_tokenizer` / `train_gpt2_bpe_tokenizer`: small BPE tokenizers trained on local text files, so nothing
  comes from the internet.

Nothing here downloads: every path must exist locally.
"""

import importlib.util
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tokenizers import Tokenizer as FastTokenizer

EOD_TOKEN = "<eod>"
UNK_TOKEN = "<unk>"
GPT2_EOD_TOKEN = "<|endoftext|>"
SENTENCEPIECE_TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# Megatron-LM's `--tokenizer-type` -> the options each needs (what they name); every other file option is an error.
_TOKENIZER_TYPE_OPTIONS = {
    "HuggingFaceTokenizer": {"--tokenizer-model": "a local Hugging Face tokenizer directory"},
    "GPT2BPETokenizer": {"--vocab-file": "a GPT-2 vocab.json", "--merge-file": "a GPT-2 merges.txt"},
    **{name: {"--tokenizer-model": "a SentencePiece .model file"} for name in SENTENCEPIECE_TOKENIZER_TYPES},
    "byte-level": {},
}
TOKENIZER_TYPES = tuple(_TOKENIZER_TYPE_OPTIONS)


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs of a tokenizer (NeMo's `TokenizerSpec` subset)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eod(self) -> int: ...

    def text_to_ids(self, text: str) -> list[int]: ...

    def ids_to_text(self, ids: Sequence[int]) -> str: ...


class ByteLevelTokenizer:
    """UTF-8 bytes as ids 0-255; id 256 ends a document. Needs no files."""

    vocab_size = 257
    eod = 256

    def text_to_ids(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def ids_to_text(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def _transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


class _FastTokenizer:
    """A `tokenizers.Tokenizer` behind the `Tokenizer` protocol; with `add_special_tokens`, encoding applies its
    post-processor (e.g. a leading BOS), as `tokenizer(text).input_ids` does."""

    def __init__(self, tokenizer: "FastTokenizer", eod: int, add_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self.eod = eod
        self.add_special_tokens = add_special_tokens

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def text_to_ids(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def ids_to_text(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def to_json(self) -> str:
        """The tokenizer as a Hugging Face `tokenizer.json`."""
        return self._tokenizer.to_str()


class HFTokenizer(_FastTokenizer):
    """A Hugging Face fast tokenizer from a local directory (or a `tokenizer.json` file). `add_special_tokens`
    (Megatron-LM's HuggingFaceTokenizer) adds what its post-processor adds, e.g. a BOS token."""

    def __init__(self, path: str | Path, eod_token: str | None = None, add_special_tokens: bool = False) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"Tokenizer {str(path)!r} does not exist: pass a local directory holding tokenizer.json (e.g. one "
                "written by nemo_ckpt.data.tokenizer.train_bpe_tokenizer or AutoTokenizer.save_pretrained)"
            )
        self.path = path
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        self._hf = None
        if path.is_dir() and (path / "tokenizer_config.json").is_file() and _transformers_available():
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            tokenizer = self._hf.backend_tokenizer
        else:
            if not tokenizer_file.is_file():
                raise FileNotFoundError(
                    f"Tokenizer directory {str(path)!r} has no tokenizer.json; save the tokenizer there with "
                    "`tokenizer.save_pretrained(dir)` or train one with train_bpe_tokenizer"
                )
            from tokenizers import Tokenizer as FastTokenizer

            tokenizer = FastTokenizer.from_file(str(tokenizer_file))
        self._tokenizer = tokenizer
        super().__init__(tokenizer, self._eod_id(eod_token), add_special_tokens)

    def _eod_id(self, eod_token: str | None) -> int:
        candidates = [eod_token] if eod_token else []
        if self._hf is not None and self._hf.eos_token_id is not None and not eod_token:
            return int(self._hf.eos_token_id)
        candidates += [EOD_TOKEN, GPT2_EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>"]
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        raise ValueError(
            f"Tokenizer {self.path}: no end-of-document token among {candidates}; pass eod_token= with one it has"
        )


class GPT2BPETokenizer(_FastTokenizer):
    """Megatron-LM's GPT2BPETokenizer: GPT-2's byte-level BPE from `vocab.json` and `merges.txt` (the Hugging Face
    `tokenizers` library, as megatron-core's GPT-2 tokenizer); `<|endoftext|>` ends documents, and is one token
    where the text holds it."""

    def __init__(self, vocab_file: str | Path, merge_file: str | Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        for path, option in ((vocab_file, "--vocab-file"), (merge_file, "--merge-file")):
            if not Path(path).is_file():
                raise FileNotFoundError(f"GPT2BPETokenizer: {option} {str(path)!r} does not exist; pass a local file")
        try:
            tokenizer = FastTokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
        except Exception as error:  # tokenizers raises a bare Exception for unreadable files
            raise ValueError(
                f"GPT2BPETokenizer: {vocab_file} / {merge_file} are not a GPT-2 vocab.json / merges.txt ({error})"
            ) from None
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        eod = tokenizer.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise ValueError(f"GPT2BPETokenizer: {vocab_file} has no {GPT2_EOD_TOKEN}, GPT-2's end-of-document token")
        tokenizer.add_special_tokens([GPT2_EOD_TOKEN])
        super().__init__(tokenizer, eod)


class SentencePieceTokenizer:
    """A SentencePiece `.model` file; its end-of-sentence id ends documents."""

    def __init__(self, model_path: str | Path) -> None:
        if not Path(model_path).is_file():
            raise FileNotFoundError(f"SentencePiece model {str(model_path)!r} does not exist; pass a local .model file")
        import sentencepiece

        self.path = Path(model_path)
        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
        eos = self._processor.eos_id()
        if eos < 0:
            raise ValueError(f"SentencePiece model {model_path} has no end-of-sentence piece; train it with eos_id>=0")
        self.eod = eos

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    def text_to_ids(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def ids_to_text(self, ids: Sequence[int]) -> str:
        return self._processor.decode([int(i) for i in ids])


def _training_texts(files: Iterable[str | Path], json_key: str | None, caller: str) -> Iterator[str]:
    """The lines of local text files, or with `json_key` the texts of JSONL files (missing files fail here)."""
    files = [Path(f) for f in files]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{caller}: training file {file} does not exist")

    def texts() -> Iterator[str]:
        for file in files:
            with open(file, encoding="utf-8") as handle:
                for line in handle:
                    yield json.loads(line)[json_key] if json_key else line

    return texts()


def train_bpe_tokenizer(
    files: Iterable[str | Path], vocab_size: int, output_dir: str | Path, json_key: str | None = None
) -> HFTokenizer:
    """Train a BPE tokenizer (Metaspace pre-tokenizer, `<eod>` and `<unk>` specials) on local files; save
    `tokenizer.json` in `output_dir` and return it. With `json_key`, the files are JSONL and that key is the text."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    texts = _training_texts(files, json_key, "train_bpe_tokenizer")
    tokenizer = FastTokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN, UNK_TOKEN], show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    temporary = output_dir / f".tokenizer.json.{os.getpid()}"
    tokenizer.save(str(temporary))
    os.replace(temporary, output_dir / "tokenizer.json")
    return HFTokenizer(output_dir)


def train_gpt2_bpe_tokenizer(
    files: Iterable[str | Path], vocab_size: int, output_dir: str | Path, json_key: str | None = None
) -> GPT2BPETokenizer:
    """Train a GPT-2-style byte-level BPE (`<|endoftext|>` its special token) on local files; save `vocab.json` and
    `merges.txt` in `output_dir` (Megatron-LM's `--vocab-file` / `--merge-file`) and return it. With `json_key`, the
    files are JSONL and that key is the text."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    texts = _training_texts(files, json_key, "train_gpt2_bpe_tokenizer")
    tokenizer = FastTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[GPT2_EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    prefix = f".tmp-{os.getpid()}"
    tokenizer.model.save(str(output_dir), prefix)
    for name in ("vocab.json", "merges.txt"):
        os.replace(output_dir / f"{prefix}-{name}", output_dir / name)
    return GPT2BPETokenizer(output_dir / "vocab.json", output_dir / "merges.txt")


def get_nmt_tokenizer(
    library: str = "byte-level", model_name: str | None = None, tokenizer_model: str | None = None
) -> Tokenizer:
    """NeMo's factory: `library` is `byte-level`, `huggingface` (`model_name` a local directory) or `sentencepiece`
    (`tokenizer_model` a `.model` file)."""
    if library in ("byte-level", "byte_level", "byte"):
        return ByteLevelTokenizer()
    if library in ("huggingface", "hf"):
        if not model_name:
            raise ValueError("get_nmt_tokenizer(library='huggingface') needs model_name=<local tokenizer directory>")
        return HFTokenizer(model_name)
    if library == "sentencepiece":
        if not tokenizer_model:
            raise ValueError("get_nmt_tokenizer(library='sentencepiece') needs tokenizer_model=<path to .model>")
        return SentencePieceTokenizer(tokenizer_model)
    raise ValueError(f"Unknown tokenizer library {library!r}; choose byte-level, huggingface or sentencepiece")


def get_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """`byte-level`, a SentencePiece `.model` file, or a local Hugging Face tokenizer directory / `tokenizer.json`."""
    if str(name_or_path) in ("byte-level", "byte_level", "byte"):
        return ByteLevelTokenizer()
    if str(name_or_path).endswith(".model"):
        return SentencePieceTokenizer(name_or_path)
    return HFTokenizer(name_or_path)


def tokenizer_type_error(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> str | None:
    """Why these arguments make no tokenizer of `tokenizer_type` (in Megatron-LM's option names), or None."""
    if tokenizer_type not in _TOKENIZER_TYPE_OPTIONS:
        return f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of {', '.join(TOKENIZER_TYPES)}"
    needed = _TOKENIZER_TYPE_OPTIONS[tokenizer_type]
    given = {"--tokenizer-model": tokenizer_model, "--vocab-file": vocab_file, "--merge-file": merge_file}
    missing = [f"{option} ({what})" for option, what in needed.items() if not given[option]]
    if missing:
        return f"--tokenizer-type {tokenizer_type} needs {' and '.join(missing)}"
    unused = [option for option, value in given.items() if value and option not in needed]
    if unused:
        return f"--tokenizer-type {tokenizer_type} does not use {' or '.join(unused)}; remove it"
    return None


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> Tokenizer:
    """Megatron-LM's `build_tokenizer`: `tokenizer_type` is one of `TOKENIZER_TYPES` (Megatron-LM's names, plus
    `byte-level`). HuggingFaceTokenizer encodes with the tokenizer's special tokens (e.g. BOS), as Megatron-LM does;
    the SentencePiece types all end documents with the model's EOS, as megatron-core's tokenizers do."""
    error = tokenizer_type_error(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    if error:
        raise ValueError(error)
    if tokenizer_type == "byte-level":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HFTokenizer(tokenizer_model, add_special_tokens=True)
    return SentencePieceTokenizer(tokenizer_model)

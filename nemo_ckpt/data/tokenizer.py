"""Tokenizers from local files, in NeMo's style: `get_tokenizer(name_or_path)` / `get_nmt_tokenizer(library, ...)`.

- `ByteLevelTokenizer`: UTF-8 bytes, no files (ids 0-255, then the end-of-document token).
- `HFTokenizer`: a Hugging Face fast tokenizer from a local directory or `tokenizer.json`
  (`AutoTokenizer.from_pretrained` when transformers is installed, else `tokenizers.Tokenizer.from_file`).
- `SentencePieceTokenizer`: a `.model` file (needs the `sentencepiece` package).
- `train_bpe_tokenizer`: a small BPE tokenizer trained on local text files, so nothing comes from the internet.

Nothing here downloads: every path must exist locally.
"""

import importlib.util
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

EOD_TOKEN = "<eod>"
UNK_TOKEN = "<unk>"


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


class HFTokenizer:
    """A Hugging Face fast tokenizer from a local directory (or a `tokenizer.json` file)."""

    def __init__(self, path: str | Path, eod_token: str | None = None) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"Tokenizer {str(path)!r} does not exist: pass a local directory holding tokenizer.json (e.g. one "
                "written by nemo_ckpt.data.tokenizers.train_bpe_tokenizer or AutoTokenizer.save_pretrained)"
            )
        self.path = path
        tokenizer_file = path / "tokenizer.json" if path.is_dir() else path
        self._hf = None
        if path.is_dir() and (path / "tokenizer_config.json").is_file() and _transformers_available():
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            self._tokenizer = self._hf.backend_tokenizer
        else:
            if not tokenizer_file.is_file():
                raise FileNotFoundError(
                    f"Tokenizer directory {str(path)!r} has no tokenizer.json; save the tokenizer there with "
                    "`tokenizer.save_pretrained(dir)` or train one with train_bpe_tokenizer"
                )
            from tokenizers import Tokenizer as FastTokenizer

            self._tokenizer = FastTokenizer.from_file(str(tokenizer_file))
        self.eod = self._eod_id(eod_token)

    def _eod_id(self, eod_token: str | None) -> int:
        candidates = [eod_token] if eod_token else []
        if self._hf is not None and self._hf.eos_token_id is not None and not eod_token:
            return int(self._hf.eos_token_id)
        candidates += [EOD_TOKEN, "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        raise ValueError(
            f"Tokenizer {self.path}: no end-of-document token among {candidates}; pass eod_token= with one it has"
        )

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def text_to_ids(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def ids_to_text(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


class SentencePieceTokenizer:
    """A SentencePiece `.model` file; its end-of-sentence id ends documents."""

    def __init__(self, model_path: str | Path) -> None:
        if not Path(model_path).is_file():
            raise FileNotFoundError(f"SentencePiece model {str(model_path)!r} does not exist; pass a local .model file")
        import sentencepiece

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


def train_bpe_tokenizer(
    files: Iterable[str | Path], vocab_size: int, output_dir: str | Path, json_key: str | None = None
) -> HFTokenizer:
    """Train a BPE tokenizer (Metaspace pre-tokenizer, `<eod>` and `<unk>` specials) on local files; save
    `tokenizer.json` in `output_dir` and return it. With `json_key`, the files are JSONL and that key is the text."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    files = [Path(f) for f in files]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"train_bpe_tokenizer: training file {file} does not exist")

    def texts() -> Iterable[str]:
        for file in files:
            with open(file, encoding="utf-8") as handle:
                for line in handle:
                    yield json.loads(line)[json_key] if json_key else line

    tokenizer = FastTokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN, UNK_TOKEN], show_progress=False)
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    temporary = output_dir / f".tokenizer.json.{os.getpid()}"
    tokenizer.save(str(temporary))
    os.replace(temporary, output_dir / "tokenizer.json")
    return HFTokenizer(output_dir)


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

"""A checkpoint's tokenizer as Hugging Face files in its `context/hf/`, as NeMo 2.0 keeps the tokenizer in a
checkpoint's context: the checkpoint alone tokenizes as its training did, and its Hugging Face export carries a
tokenizer `transformers.AutoTokenizer` loads with the same ids.

- `ByteLevelTokenizer`: an equivalent `tokenizer.json` (a BPE over the 256 byte symbols of the ByteLevel
  pre-tokenizer, no merges, `<eod>` special at 256; a literal "<eod>" in text stays bytes, `split_special_tokens`).
- `HFTokenizer`: its files (`tokenizer.json`, `tokenizer_config.json`, ...).
- `SentencePieceTokenizer`: its `.model` as `tokenizer.model`, which transformers (>= 5) loads as a fast tokenizer
  following the model's own normalization (special tokens written in text stay text, as in SentencePiece).

`tokenizer_config.json` names the end-of-document token as `eos_token`, and as `pad_token` where the tokenizer has
no pad (as NeMo's and Hugging Face's Llama exports do).
"""

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_ckpt.data.tokenizer import (
    EOD_TOKEN,
    GPT2_EOD_TOKEN,
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
)
from nemo_ckpt.dist_checkpointing.core import fsync_path, write_durably

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, SENTENCEPIECE_MODEL, "chat_template.jinja")
FAST_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
TOKEN_ID_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "pad_token": "pad_token_id"}

Files = dict[str, bytes]


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (`bytes_to_unicode`), the ByteLevel alphabet."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, extra = [], 0
    for byte in range(256):
        symbols.append(chr(byte) if byte in printable else chr(256 + extra))
        extra += byte not in printable
    return symbols


def byte_level_tokenizer_json() -> str:
    """`ByteLevelTokenizer` as a Hugging Face `tokenizer.json`: id b is byte b, `<eod>` is 256."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as FastTokenizer

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    backend = FastTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    return backend.to_str()


def _sentencepiece(model: bytes) -> Any:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_proto=model)


def _content(token: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string, or an AddedToken dict with `content`."""
    return token.get("content") if isinstance(token, dict) else token


def _token_of(files: Files, token_id: int) -> str | None:
    if TOKENIZER_JSON in files:
        from tokenizers import Tokenizer as FastTokenizer

        return FastTokenizer.from_str(files[TOKENIZER_JSON].decode()).id_to_token(token_id)
    if SENTENCEPIECE_MODEL in files:
        return _sentencepiece(files[SENTENCEPIECE_MODEL]).id_to_piece(token_id)
    return None


def _with_special_tokens(files: Files, eos_token: str, pad_token: str | None = None, **settings: Any) -> Files:
    """`files` whose `tokenizer_config.json` (made if absent) and `special_tokens_map.json` (if present) name
    `eos_token` and, unless they name a pad token, `pad_token` (default: the eos); `settings` (bos_token, ...) are
    added to `tokenizer_config.json` where it lacks them."""
    files = dict(files)
    for name in (TOKENIZER_CONFIG, *([SPECIAL_TOKENS_MAP] if SPECIAL_TOKENS_MAP in files else [])):
        config = json.loads(files[name]) if name in files else {"tokenizer_class": FAST_TOKENIZER_CLASS}
        if _content(config.get("eos_token")) != eos_token:
            config["eos_token"] = eos_token
        if config.get("pad_token") is None:
            config["pad_token"] = pad_token or eos_token
        if name == TOKENIZER_CONFIG:
            config = {**settings, **config}
        files[name] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
    return files


def tokenizer_files(tokenizer: Tokenizer) -> Files | None:
    """The Hugging Face files of `tokenizer` (name -> content), or None for a tokenizer they cannot describe."""
    if type(tokenizer) is ByteLevelTokenizer:
        # `<eod>` also begins each document of the token stream, as GPT-2's <|endoftext|> does: it is the bos too
        files = {TOKENIZER_JSON: byte_level_tokenizer_json().encode()}
        return _with_special_tokens(files, EOD_TOKEN, bos_token=EOD_TOKEN, split_special_tokens=True)
    if isinstance(tokenizer, HFTokenizer):
        path = tokenizer.path
        if path.is_file():
            files = {TOKENIZER_JSON: path.read_bytes()}
        else:
            files = {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
        eos = _token_of(files, tokenizer.eod)
        return None if eos is None else _with_special_tokens(files, eos)
    if isinstance(tokenizer, GPT2BPETokenizer):  # <|endoftext|> begins and ends GPT-2's documents
        files = {TOKENIZER_JSON: tokenizer.to_json().encode()}
        return _with_special_tokens(files, GPT2_EOD_TOKEN, bos_token=GPT2_EOD_TOKEN)
    if isinstance(tokenizer, SentencePieceTokenizer):
        files = {SENTENCEPIECE_MODEL: tokenizer.path.read_bytes()}
        processor = _sentencepiece(files[SENTENCEPIECE_MODEL])
        pieces = {"bos_token": processor.bos_id(), "unk_token": processor.unk_id(), "pad_token": processor.pad_id()}
        named = {key: processor.id_to_piece(piece_id) for key, piece_id in pieces.items() if piece_id >= 0}
        eos = processor.id_to_piece(tokenizer.eod)
        return _with_special_tokens(files, eos, **named, split_special_tokens=True)
    return None


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> list[str]:
    """Write `tokenizer`'s Hugging Face files into `directory`, each fsynced, with the directory; return their
    names. A tokenizer they cannot describe, or whose files cannot be read, is skipped with a warning."""
    try:
        files = tokenizer_files(tokenizer)
    except OSError as error:
        log.warning(
            "%s: the tokenizer's files could not be read (%s); the checkpoint stores no tokenizer", directory, error
        )
        return []
    if files is None:
        log.warning(
            "%s: a %s is not stored with the checkpoint (byte-level, Hugging Face and SentencePiece tokenizers are); "
            "its Hugging Face export will carry no tokenizer",
            directory,
            type(tokenizer).__name__,
        )
        return []
    write_files(files, directory)
    return sorted(files)


def write_files(files: Files, directory: Path) -> None:
    """Create `directory` (if needed) and each of `files` in it, durably."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        write_durably(directory / name, lambda file, data=content: file.write(data))
    fsync_path(directory)


def stored_tokenizer_files(directory: Path) -> Files:
    """The tokenizer stored in `directory` (a checkpoint's `context/hf`) as training builds it from there
    (`HFTokenizer`): eos its end-of-document token, pad defaulting to eos. Files it cannot load go as they are."""
    try:
        files = tokenizer_files(HFTokenizer(directory))
    except (FileNotFoundError, ValueError) as error:
        log.warning("%s: the tokenizer does not load (%s); its files go as they are", directory, error)
        files = None
    return files or {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` holds a tokenizer's vocabulary (`tokenizer.json` or `tokenizer.model`)."""
    return (directory / TOKENIZER_JSON).is_file() or (directory / SENTENCEPIECE_MODEL).is_file()


def _vocabulary(files: Files) -> tuple[Callable[[str], int | None], int]:
    """A token -> id lookup of the tokenizer `files`, and its number of ids."""
    if TOKENIZER_JSON in files:
        from tokenizers import Tokenizer as FastTokenizer

        backend = FastTokenizer.from_str(files[TOKENIZER_JSON].decode())
        return backend.token_to_id, backend.get_vocab_size(with_added_tokens=True)
    processor = _sentencepiece(files[SENTENCEPIECE_MODEL])

    def piece_id(piece: str) -> int | None:
        piece_id = processor.piece_to_id(piece)
        return piece_id if processor.id_to_piece(piece_id) == piece else None

    return piece_id, processor.get_piece_size()


def vocabulary_size(files: Files) -> int:
    """The number of ids the tokenizer `files` produce."""
    return _vocabulary(files)[1]


def special_token_ids(files: Files) -> dict[str, int | None]:
    """`bos_token_id`, `eos_token_id` and `pad_token_id` of the tokenizer `files` (None: it names no such token),
    from `tokenizer_config.json`, overridden by `special_tokens_map.json` as transformers reads them."""
    named: dict[str, Any] = {}
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if name in files:
            named |= {key: value for key, value in json.loads(files[name]).items() if key in TOKEN_ID_KEYS}
    token_id, _ = _vocabulary(files)
    ids = {}
    for key, id_key in TOKEN_ID_KEYS.items():
        token = _content(named.get(key))
        ids[id_key] = None if token is None else token_id(token)
    return ids

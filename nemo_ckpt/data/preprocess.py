"""Tokenize JSONL into Megatron indexed datasets: Megatron-LM's `tools/preprocess_data.py`, its options, its bytes.

    python -m nemo_ckpt.data.preprocess --input corpus.jsonl [more.jsonl ...] --json-keys text \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --output-prefix out --workers 2 --append-eod [--split-sentences] [--partitions 2]

writes `out_text_document.bin` / `.idx` (`out_text_sentence` with `--split-sentences`): one dataset per JSON key,
every input file merged into it, byte for byte what Megatron-LM writes for the same documents and tokenizer.
`--tokenizer-type` takes Megatron-LM's names (HuggingFaceTokenizer, GPT2BPETokenizer, the SentencePiece ones) and
`byte-level`; `--tokenizer` is the shorthand of `get_tokenizer` (byte-level, a local Hugging Face directory, a .model).

Documents as Megatron-LM writes them: every JSON line is a document, an empty text included (a document of no
sequence and no EOD: its document index repeats the previous one); a list of strings is a document of those
sequences (Megatron-LM's sentence-split files); blank lines are skipped (Megatron-LM fails on them).
`--append-eod` ends every non-empty document with the tokenizer's EOD. A key without a single token is an error.

`--split-sentences` makes each sentence a sequence. Megatron-LM splits with NLTK's punkt model, a download; here
`split_sentences` (no dependency) breaks after `.`, `!` or `?` (and closing quotes or brackets) followed by
whitespace: punkt's rule without its learnt abbreviations ("Dr. No" is two sentences). `--keep-newlines` keeps the
whitespace after each sentence in it.

`--partitions N` orders documents as Megatron-LM's partitions do: dealt round-robin into N partitions written one
after the other (with `--keep-sequential-samples`, in input order). The `--workers` tokenize whatever the partitions;
the partitions are written apart, then merged (twice the output's disk space meanwhile).

Reading is streamed in chunks with a bounded number in flight, so memory stays constant whatever the input size.
Outputs are written under temporary names and renamed at the end: a failed run leaves nothing behind. At the end it
prints the documents, tokens and throughput (documents/s, MB/s with Megatron-LM's MB of 2**20 bytes).
"""

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nemo_ckpt.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from nemo_ckpt.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer, get_tokenizer, tokenizer_type_error

CHUNK_LINES = 512
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]}\u2019\u201d]*(\s+)(?=\S)")


@dataclass(frozen=True)
class PreprocessConfig:
    """The command line's options. The tokenizer is `tokenizer_type` (with its files) or the `tokenizer` shorthand."""

    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer: str | None = None
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    split_sentences: bool = False
    keep_newlines: bool = False
    partitions: int = 1
    keep_sequential_samples: bool = False


@dataclass(frozen=True)
class PreprocessSummary:
    """What a run wrote: the dataset prefixes, its documents and tokens (all keys), the input bytes, the seconds."""

    prefixes: list[str]
    documents: int
    tokens: int
    input_bytes: int
    seconds: float

    def __str__(self) -> str:
        seconds = max(self.seconds, 1e-6)
        return (
            f"Processed {self.documents} documents, {self.tokens} tokens in {self.seconds:.2f} s "
            f"({self.documents / seconds:.1f} documents/s, {self.input_bytes / seconds / 2**20:.2f} MB/s)"
        )


def output_prefix_for(output_prefix: str, json_key: str, split_sentences: bool = False) -> str:
    """Megatron's output name: `<prefix>_<key>_document`, or `<prefix>_<key>_sentence` with sentences split."""
    return f"{output_prefix}_{json_key}_{'sentence' if split_sentences else 'document'}"


def config_error(config: PreprocessConfig) -> str | None:
    """Why `config` cannot run (in the command line's option names), or None."""
    if not config.json_keys:
        return "--json-keys: give at least one key"
    files = {
        "--tokenizer-model": config.tokenizer_model,
        "--vocab-file": config.vocab_file,
        "--merge-file": config.merge_file,
    }
    given = [option for option, value in files.items() if value]
    if config.tokenizer is not None and config.tokenizer_type is not None:
        return "--tokenizer and --tokenizer-type are alternatives; give one"
    if config.tokenizer is None and config.tokenizer_type is None:
        return f"give --tokenizer-type ({', '.join(TOKENIZER_TYPES)}) or the --tokenizer shorthand"
    if config.tokenizer is not None and given:
        return f"--tokenizer takes no {' or '.join(given)}; give --tokenizer-type with them"
    if config.tokenizer_type is not None:
        error = tokenizer_type_error(config.tokenizer_type, *files.values())
        if error:
            return error
    if config.workers < 1:
        return "--workers must be at least 1"
    if config.partitions < 1:
        return "--partitions must be at least 1"
    if config.keep_newlines and not config.split_sentences:
        return "--keep-newlines applies to --split-sentences; give both or neither"
    if config.keep_sequential_samples and config.partitions == 1:
        return "--keep-sequential-samples applies to --partitions above 1; give both or neither"
    return None


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """The sentences of `text`: a break after `.`, `!` or `?` (and closing quotes or brackets) followed by whitespace.
    The whitespace between sentences is dropped, or with `keep_newlines` kept at the end of the sentence before it."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        sentences.append(text[start : match.end() if keep_newlines else match.start(1)])
        start = match.end()
    sentences.append(text[start:])
    if keep_newlines:
        return [sentence for sentence in sentences if sentence]
    return [sentence.strip() for sentence in sentences if sentence.strip()]


def _tokenizer(config: PreprocessConfig) -> Tokenizer:
    if config.tokenizer_type is not None:
        return build_tokenizer(config.tokenizer_type, config.tokenizer_model, config.vocab_file, config.merge_file)
    return get_tokenizer(config.tokenizer)


_worker_tokenizer: Tokenizer | None = None
_worker_config: PreprocessConfig | None = None


def _init_worker(config: PreprocessConfig, tokenizer: Tokenizer | None = None) -> None:
    global _worker_tokenizer, _worker_config
    _worker_tokenizer = tokenizer if tokenizer is not None else _tokenizer(config)
    _worker_config = config


def _encode(value: str | list[str]) -> tuple[np.ndarray, list[int]]:
    """Megatron-LM's `Encoder.encode` of one key: the document's tokens and its sequence lengths (one per non-empty
    sentence); the EOD, when appended, ends the last sequence of a non-empty document."""
    tokenizer, config = _worker_tokenizer, _worker_config
    texts = value if isinstance(value, list) else [value]
    if config.split_sentences:
        texts = [sentence for text in texts for sentence in split_sentences(text, config.keep_newlines)]
    ids, lengths = [], []
    for text in texts:
        sentence_ids = tokenizer.text_to_ids(text)
        if sentence_ids:
            ids.extend(sentence_ids)
            lengths.append(len(sentence_ids))
    if ids and config.append_eod:
        ids.append(tokenizer.eod)
        lengths[-1] += 1
    return np.asarray(ids, dtype=np.int64), lengths


def _encode_chunk(chunk: list[tuple[str, int, str]]) -> tuple[list[list[tuple[np.ndarray, list[int]]]], int]:
    """(tokens, sequence lengths) per document per key, and the characters read."""
    documents, num_chars = [], 0
    for file, line_number, line in chunk:
        num_chars += len(line)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}:{line_number} is not valid JSON ({error}); the input must be JSONL") from None
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{line_number} is a JSON {type(record).__name__}, not an object; it must be one")
        encoded = []
        for key in _worker_config.json_keys:
            if key not in record:
                raise ValueError(f"{file}:{line_number} has no key {key!r} (keys: {sorted(record)}); fix --json-keys")
            value = record[key]
            if not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ValueError(f"{file}:{line_number}: {key!r} is neither a string nor a list of strings")
            encoded.append(_encode(value))
        documents.append(encoded)
    return documents, num_chars


def _chunks(inputs: Sequence[str]) -> Iterator[list[tuple[str, int, str]]]:
    chunk = []
    for file in inputs:
        with open(file, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                chunk.append((file, line_number, line))
                if len(chunk) == CHUNK_LINES:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def _encoded_chunks(
    config: PreprocessConfig, tokenizer: Tokenizer
) -> Iterator[tuple[list[list[tuple[np.ndarray, list[int]]]], int]]:
    """Encoded chunks in input order; with several workers (each building its tokenizer), at most 4 chunks per
    worker in flight."""
    if config.workers <= 1:
        _init_worker(config, tokenizer)
        for chunk in _chunks(config.inputs):
            yield _encode_chunk(chunk)
        return
    with multiprocessing.Pool(config.workers, initializer=_init_worker, initargs=(config,)) as pool:
        in_flight = deque()
        for chunk in _chunks(config.inputs):
            in_flight.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(in_flight) >= 4 * config.workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def run_preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Tokenize `config.inputs` into one indexed dataset per JSON key; say what was written."""
    error = config_error(config)
    if error:
        raise ValueError(error)
    missing = [file for file in config.inputs if not os.path.isfile(file)]
    if missing:
        raise FileNotFoundError(f"--input: {', '.join(missing)} not found")
    start = time.perf_counter()
    tokenizer = _tokenizer(config)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = [output_prefix_for(config.output_prefix, key, config.split_sentences) for key in config.json_keys]
    Path(config.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    temporary = f".tmp-{os.getpid()}"
    num_parts = 1 if config.keep_sequential_samples else config.partitions
    parts = [[f"{prefix}{temporary}-{i}" for i in range(num_parts)] for prefix in prefixes]  # per key, per partition
    merged = [f"{prefix}{temporary}" if num_parts > 1 else key_parts[0] for prefix, key_parts in zip(prefixes, parts)]
    every_part = {part for key_parts in parts for part in key_parts} | set(merged)
    written = [path for part in every_part for path in (get_bin_path(part), get_idx_path(part))]
    try:
        builders = [[IndexedDatasetBuilder(get_bin_path(part), dtype) for part in key_parts] for key_parts in parts]
        num_documents, tokens = 0, [0] * len(prefixes)
        total_bytes = sum(os.path.getsize(file) for file in config.inputs)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=None) as progress:
            for documents, num_chars in _encoded_chunks(config, tokenizer):
                for encoded in documents:
                    for key_index, (ids, lengths) in enumerate(encoded):
                        builders[key_index][num_documents % num_parts].add_document(ids, lengths)
                        tokens[key_index] += len(ids)
                    num_documents += 1
                progress.update(num_chars)
        empty = [key for key, count in zip(config.json_keys, tokens) if count == 0]
        if empty:
            raise ValueError(
                f"--input {', '.join(config.inputs)}: no token of --json-keys {', '.join(empty)} in its "
                f"{num_documents} documents; nothing to write"
            )
        for key_parts, key_builders, target in zip(parts, builders, merged):
            for part, builder in zip(key_parts, key_builders):
                builder.finalize(get_idx_path(part))
            if num_parts > 1:
                merger = IndexedDatasetBuilder(get_bin_path(target), dtype)
                for part in key_parts:
                    merger.add_index(part)
                merger.finalize(get_idx_path(target))
        for source, prefix in zip(merged, prefixes):
            os.replace(get_bin_path(source), get_bin_path(prefix))
            os.replace(get_idx_path(source), get_idx_path(prefix))
    finally:
        for path in written:
            if os.path.exists(path):
                os.remove(path)
    return PreprocessSummary(prefixes, num_documents, sum(tokens), total_bytes, time.perf_counter() - start)


def preprocess(config: PreprocessConfig) -> list[str]:
    """Tokenize `config.inputs` into one indexed dataset per JSON key; return their path prefixes."""
    return run_preprocess(config).prefixes


def parse_args(argv: Sequence[str] | None = None) -> PreprocessConfig:
    parser = argparse.ArgumentParser(prog="python -m nemo_ckpt.data.preprocess", description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True, help="JSONL files, one document per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    group.add_argument("--split-sentences", action="store_true", help="write each sentence as a sequence")
    group.add_argument("--keep-newlines", action="store_true", help="keep the whitespace after each split sentence")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="Megatron-LM's tokenizer names, or byte-level")
    group.add_argument(
        "--tokenizer-model", help="HuggingFaceTokenizer: a local directory; the SentencePiece types: a .model file"
    )
    group.add_argument("--vocab-file", help="GPT2BPETokenizer: its vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer: its merges.txt")
    group.add_argument(
        "--tokenizer", help="instead of --tokenizer-type: byte-level, a local Hugging Face directory or a .model file"
    )
    group = parser.add_argument_group("tokenization process")
    group.add_argument("--append-eod", action="store_true", help="end every non-empty document with the EOD token")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document (or _sentence) .bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument("--partitions", type=int, default=1, help="order documents as Megatron-LM's N partitions do")
    group.add_argument(
        "--keep-sequential-samples", action="store_true", help="with --partitions: keep the input's document order"
    )
    args = parser.parse_args(argv)
    config = PreprocessConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer=args.tokenizer,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
    )
    error = config_error(config)
    if error:
        parser.error(error)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        summary = run_preprocess(config)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for prefix in summary.prefixes:
        print(f"wrote {get_bin_path(prefix)} and {get_idx_path(prefix)}")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

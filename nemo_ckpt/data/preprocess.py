"""Tokenize JSONL into Megatron indexed datasets (the names of Megatron-LM's `tools/preprocess_data.py`).

    python -m nemo_ckpt.data.preprocess --input corpus.jsonl [more.jsonl ...] --json-keys text \
        --tokenizer path/to/tokenizer_dir --output-prefix out --workers 2 --append-eod

writes `out_text_document.bin` / `.idx` (one dataset per JSON key, every input file merged into it). Reading is
streamed in chunks with a bounded number in flight, so memory stays constant whatever the input size. Outputs are
written under temporary names and renamed at the end: a failed run leaves nothing behind.
"""

import argparse
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nemo_ckpt.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from nemo_ckpt.data.tokenizer import Tokenizer, get_tokenizer

CHUNK_LINES = 512


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer: str
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1


def output_prefix_for(output_prefix: str, json_key: str) -> str:
    """Megatron's output name: `<prefix>_<key>_document`."""
    return f"{output_prefix}_{json_key}_document"


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = get_tokenizer(tokenizer_name)


def _encode_chunk(
    chunk: list[tuple[str, int, str]], json_keys: Sequence[str], append_eod: bool
) -> tuple[list[list[np.ndarray]], int]:
    """Token arrays per document per key, and the bytes of text read."""
    tokenizer = _worker_tokenizer
    texts = {key: [] for key in json_keys}
    num_bytes = 0
    for file, line_number, line in chunk:
        num_bytes += len(line)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file}:{line_number} is not valid JSON ({error}); the input must be JSONL") from None
        for key in json_keys:
            if key not in record:
                raise ValueError(f"{file}:{line_number} has no key {key!r} (keys: {sorted(record)}); fix --json-keys")
            texts[key].append(record[key])
    eod = [tokenizer.eod] if append_eod else []
    encoded = [[tokenizer.text_to_ids(text) + eod for text in texts[key]] for key in json_keys]
    documents = [[np.asarray(ids, dtype=np.int64) for ids in per_key] for per_key in zip(*encoded)]
    return documents, num_bytes


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


def _encoded_chunks(config: PreprocessConfig) -> Iterator[tuple[list[list[np.ndarray]], int]]:
    """Encoded chunks in input order; with several workers, at most 4 chunks per worker in flight."""
    if config.workers <= 1:
        _init_worker(config.tokenizer)
        for chunk in _chunks(config.inputs):
            yield _encode_chunk(chunk, config.json_keys, config.append_eod)
        return
    with multiprocessing.Pool(config.workers, initializer=_init_worker, initargs=(config.tokenizer,)) as pool:
        in_flight = deque()
        for chunk in _chunks(config.inputs):
            in_flight.append(pool.apply_async(_encode_chunk, (chunk, config.json_keys, config.append_eod)))
            if len(in_flight) >= 4 * config.workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def preprocess(config: PreprocessConfig) -> list[str]:
    """Tokenize `config.inputs` into one indexed dataset per JSON key; return their path prefixes."""
    missing = [file for file in config.inputs if not os.path.isfile(file)]
    if missing:
        raise FileNotFoundError(f"--input: {', '.join(missing)} not found")
    if not config.json_keys:
        raise ValueError("--json-keys: give at least one key")
    tokenizer = get_tokenizer(config.tokenizer)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    prefixes = [output_prefix_for(config.output_prefix, key) for key in config.json_keys]
    Path(config.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    suffix = f".tmp-{os.getpid()}"
    temporary = [(get_bin_path(p) + suffix, get_idx_path(p) + suffix) for p in prefixes]
    try:
        builders = [IndexedDatasetBuilder(bin_path, dtype) for bin_path, _ in temporary]
        num_documents = 0
        total_bytes = sum(os.path.getsize(file) for file in config.inputs)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=None) as progress:
            for documents, num_bytes in _encoded_chunks(config):
                for encoded in documents:
                    if all(len(ids) == 0 for ids in encoded):
                        continue
                    for builder, ids in zip(builders, encoded):
                        builder.add_document(ids, [len(ids)])
                    num_documents += 1
                progress.update(num_bytes)
        if num_documents == 0:
            raise ValueError(f"--input {', '.join(config.inputs)}: no non-empty document; nothing to write")
        for builder, (_, idx_path) in zip(builders, temporary):
            builder.finalize(idx_path)
        for prefix, (bin_path, idx_path) in zip(prefixes, temporary):
            os.replace(bin_path, get_bin_path(prefix))
            os.replace(idx_path, get_idx_path(prefix))
    finally:
        for paths in temporary:
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
    return prefixes


def parse_args(argv: Sequence[str] | None = None) -> PreprocessConfig:
    parser = argparse.ArgumentParser(prog="python -m nemo_ckpt.data.preprocess", description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSONL files, one document per line")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    parser.add_argument(
        "--tokenizer", required=True, help="byte-level, a local Hugging Face tokenizer directory, or a .model file"
    )
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's EOD")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return PreprocessConfig(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer=args.tokenizer,
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        workers=args.workers,
    )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        prefixes = preprocess(config)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for prefix in prefixes:
        print(f"wrote {get_bin_path(prefix)} and {get_idx_path(prefix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

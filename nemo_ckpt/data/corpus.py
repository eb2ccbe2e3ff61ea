"""A small corpus the project generates itself (license-clean), tokenized for the real-data recipes.

`prepare_tiny_corpus(directory, vocab_size)` writes `corpus.jsonl` (short stories from a fixed grammar), trains a
BPE tokenizer on it (`tokenizer/tokenizer.json`) and preprocesses it into `corpus_text_document.bin/.idx`. It runs
once: later calls (and other ranks, which wait on a file lock) reuse the files.
"""

import fcntl
import json
import math
import os
import random
from collections import Counter
from pathlib import Path

from nemo_ckpt.data.indexed_dataset import IndexedDataset
from nemo_ckpt.data.preprocess import PreprocessConfig, output_prefix_for, preprocess
from nemo_ckpt.data.tokenizer import train_bpe_tokenizer

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gus", "Hana", "Ivo", "June", "Kai", "Lena"]
ANIMALS = ["cat", "dog", "fox", "owl", "bear", "hare", "crow", "frog", "goat", "wolf"]
ADJECTIVES = ["small", "old", "quiet", "red", "brave", "sleepy", "clever", "happy", "tired", "young"]
PLACES = ["forest", "river", "garden", "market", "village", "hill", "lake", "field", "bridge", "library"]
THINGS = ["apple", "book", "lamp", "basket", "kite", "letter", "map", "coat", "drum", "key"]
VERBS = [("found", "finds"), ("carried", "carries"), ("lost", "loses"), ("painted", "paints"), ("hid", "hides")]


def _story(rng: random.Random) -> str:
    name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
    adjective = rng.choice(ADJECTIVES)
    sentences = [f"Once upon a time, {name} lived near the {place} with a {adjective} {animal}."]
    for _ in range(rng.randint(2, 6)):
        thing, (past, present) = rng.choice(THINGS), rng.choice(VERBS)
        template = rng.randrange(4)
        if template == 0:
            sentences.append(f"One day {name} {past} a {rng.choice(ADJECTIVES)} {thing} by the {rng.choice(PLACES)}.")
        elif template == 1:
            sentences.append(f"The {animal} {past} the {thing}, and {name} laughed.")
        elif template == 2:
            sentences.append(f"Every morning the {adjective} {animal} {present} a {thing} in the {place}.")
        else:
            sentences.append(f"{name} said: the {thing} is {rng.choice(ADJECTIVES)} today.")
    sentences.append(f"In the end, {name} and the {animal} went home to the {place}.")
    return " ".join(sentences)


def write_corpus(path: str | Path, num_documents: int, seed: int = 0) -> None:
    """`num_documents` generated stories as JSONL (`{"text": ...}` per line)."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(num_documents):
            handle.write(json.dumps({"text": _story(rng)}) + "\n")


def unigram_entropy(path_prefix: str | Path) -> float:
    """The entropy (nats per token) of the token frequencies of an indexed dataset: the loss of a model that knows
    only how often each token occurs."""
    dataset = IndexedDataset(path_prefix)
    counts = Counter()
    for sequence in dataset[0 : len(dataset)]:
        counts.update(sequence.tolist())
    total = sum(counts.values())
    return -sum(count / total * math.log(count / total) for count in counts.values())


def prepare_tiny_corpus(directory: str | Path, vocab_size: int, num_documents: int = 2000, seed: int = 0) -> str:
    """Generate, tokenize and preprocess the corpus in `directory` (once); return the dataset's path prefix."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    output_prefix = str(directory / "corpus")
    prefix = output_prefix_for(output_prefix, "text")
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not IndexedDataset.exists(prefix):
            corpus = directory / "corpus.jsonl"
            temporary = directory / f".corpus.jsonl.tmp-{os.getpid()}"
            write_corpus(temporary, num_documents, seed)
            os.replace(temporary, corpus)
            train_bpe_tokenizer([corpus], vocab_size, directory / "tokenizer", json_key="text")
            preprocess(
                PreprocessConfig(
                    inputs=(str(corpus),),
                    output_prefix=output_prefix,
                    tokenizer=str(directory / "tokenizer"),
                    append_eod=True,
                )
            )
    return prefix

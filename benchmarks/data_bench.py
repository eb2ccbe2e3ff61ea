"""Real-data pipeline speed: preprocessing throughput, GPT index building, data loading.

    python benchmarks/data_bench.py [--documents 20000] [--index-documents 1000000] [--reps 3] [--no-write]

- Preprocessing: tokens/s of `nemo_ckpt.data.preprocess` with 1 and all workers, against a faithful re-run of
  Megatron-LM's `tools/preprocess_data.py` loop (`Pool.imap(encode, lines, 32)`, one `add_document` per line into
  megatron-core's builder when importable, else ours) with the same BPE tokenizer and corpus, and against the disk
  (reading the JSONL and writing the token stream, fsynced).
- Index building: the document, sample and shuffle indices of one epoch of `--index-documents` documents (a sparse
  `.bin`), ours (numpy) against megatron-core's `GPTDataset` (its C++ `build_sample_idx`) when importable; the
  blending index of as many samples, ours against megatron-core's C++ `build_blending_indices`.
- Loading: samples/s that `PreTrainingDataModule`'s loader (GPTDataset, 2 workers, one micro-batch or
  `micro_batches_per_fetch` of them per worker hand-over) delivers, against the samples/s the tiny model trains
  on (one process, one thread), and the anonymous memory of reading samples from a small and a large corpus
  (memory-mapped: it does not grow with the corpus).
Medians of `--reps`. Writes the `## Data` section of benchmarks/RESULTS.md.
"""

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

import numpy as np
import torch
from results import MEGATRON_CORE_INSTALL, check_dependencies, write_section

from nemo_ckpt.data.blended_dataset import build_blending_indices
from nemo_ckpt.data.corpus import write_corpus
from nemo_ckpt.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split
from nemo_ckpt.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path
from nemo_ckpt.data.preprocess import PreprocessConfig, preprocess
from nemo_ckpt.data.tokenizer import get_tokenizer, train_bpe_tokenizer


def megatron_core():
    """megatron-core's dataset modules, or None."""
    try:
        from megatron.core.datasets import indexed_dataset
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MegatronGPTDatasetConfig
    except ImportError:
        return None
    return indexed_dataset, BlendedMegatronDatasetBuilder, MegatronGPTDataset, MegatronGPTDatasetConfig


def median_time(function, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class MegatronEncoder:
    """Megatron-LM's `Encoder`: a tokenizer per worker, `encode(json_line)` -> ids, lengths, bytes."""

    def __init__(self, tokenizer: str) -> None:
        self.tokenizer_name = tokenizer

    def initializer(self) -> None:
        MegatronEncoder.tokenizer = get_tokenizer(self.tokenizer_name)

    def encode(self, json_line: str):
        data = json.loads(json_line)
        ids = MegatronEncoder.tokenizer.text_to_ids(data["text"])
        ids.append(MegatronEncoder.tokenizer.eod)
        return {"text": ids}, {"text": [len(ids)]}, len(json_line)


def megatron_loop(corpus: Path, tokenizer: str, prefix: Path, workers: int) -> None:
    """Megatron-LM's `preprocess_data.py` main loop (one partition, no sentence splitting, --append-eod)."""
    core = megatron_core()
    encoder = MegatronEncoder(tokenizer)
    vocab_size = get_tokenizer(tokenizer).vocab_size
    dtype = np.uint16 if vocab_size < 65500 else np.int32
    builder_class = core[0].IndexedDatasetBuilder if core else IndexedDatasetBuilder
    builder = builder_class(f"{prefix}.bin", dtype=dtype)
    with (
        open(corpus, encoding="utf-8") as lines,
        multiprocessing.get_context("fork").Pool(workers, initializer=encoder.initializer) as pool,
    ):
        for doc, lengths, _ in pool.imap(encoder.encode, lines, 32):
            builder.add_document(torch.IntTensor(doc["text"]) if core else doc["text"], lengths["text"])
    builder.finalize(f"{prefix}.idx")


def disk_limit(corpus: Path, tokens: int, directory: Path) -> float:
    """Seconds to read the corpus and write (and fsync) its token stream."""
    start = time.perf_counter()
    with open(corpus, "rb") as handle:
        while handle.read(16 << 20):
            pass
    stream = np.zeros(tokens, dtype=np.uint16)
    with open(directory / "disk.bin", "wb") as handle:
        stream.tofile(handle)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - start


def bench_preprocessing(directory: Path, documents: int, reps: int) -> list[str]:
    corpus = directory / "corpus.jsonl"
    write_corpus(corpus, documents)
    train_bpe_tokenizer([corpus], 1024, directory / "tokenizer", json_key="text")
    tokenizer = str(directory / "tokenizer")
    workers = os.cpu_count() or 1
    rows, tokens = [], None
    runs = {
        "nemo_ckpt.data.preprocess, 1 worker": lambda: preprocess(
            PreprocessConfig((str(corpus),), str(directory / "ours1"), tokenizer, append_eod=True, workers=1)
        ),
        f"nemo_ckpt.data.preprocess, {workers} workers": lambda: preprocess(
            PreprocessConfig((str(corpus),), str(directory / "oursN"), tokenizer, append_eod=True, workers=workers)
        ),
        "Megatron-LM loop, 1 worker": lambda: megatron_loop(corpus, tokenizer, directory / "mlm1", 1),
        f"Megatron-LM loop, {workers} workers": lambda: megatron_loop(corpus, tokenizer, directory / "mlmN", workers),
    }
    for name, run in runs.items():
        seconds = median_time(run, reps)
        if tokens is None:
            tokens = int(IndexedDataset(directory / "ours1_text_document").sequence_lengths.sum())
        rows.append((name, seconds))
    rows.append(
        ("disk: read JSONL + write tokens (fsync)", median_time(lambda: disk_limit(corpus, tokens, directory), reps))
    )
    size_mb = corpus.stat().st_size / 1e6
    lines = [
        f"Preprocessing {documents} documents ({size_mb:.1f} MB of JSONL, {tokens} tokens, BPE vocab 1024):",
        "",
        "| run | seconds | tokens/s | vs Megatron-LM loop, same workers |",
        "| --- | ---: | ---: | ---: |",
    ]
    baseline = {1: rows[2][1], workers: rows[3][1]}
    for index, (name, seconds) in enumerate(rows):
        ratio = ""
        if index < 4:
            ratio = f"{baseline[1 if index % 2 == 0 else workers] / seconds:.2f}x"
        lines.append(f"| {name} | {seconds:.2f} | {tokens / seconds:,.0f} | {ratio} |")
    return lines


def sparse_dataset(prefix: Path, documents: int) -> IndexedDataset:
    """`documents` documents of 1-200 tokens, the `.bin` a sparse file of the right size."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, documents, dtype=np.int32)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), np.uint16)
    builder.sequence_lengths = array("i", lengths.tobytes())
    builder.document_indices = array("q", range(documents + 1))
    builder.finalize(f"{prefix}.idx")
    os.truncate(get_bin_path(prefix), int(lengths.sum()) * 2)
    return IndexedDataset(prefix)


def bench_index(directory: Path, documents: int, reps: int) -> list[str]:
    dataset = sparse_dataset(directory / "big", documents)
    runs = iter(range(10_000))

    def ours() -> None:
        config = GPTDatasetConfig(seq_length=2048, eod=0, path_to_cache=str(directory / f"ours-{next(runs)}"))
        GPTDataset(dataset, np.arange(documents, dtype=np.int32), None, Split.train, config)

    rows = [("ours (numpy)", median_time(ours, reps))]
    blending = [("ours (Python loop)", median_time(lambda: build_blending_indices([0.3, 0.7], documents), reps))]
    core = megatron_core()
    if core:
        from megatron.core.datasets import helpers

        def megatron_blending() -> None:
            dataset_index, sample_index = np.zeros(documents, np.int16), np.zeros(documents, np.int64)
            helpers.build_blending_indices(dataset_index, sample_index, np.array([0.3, 0.7]), 2, documents, False)

        blending.append(("megatron-core (C++)", median_time(megatron_blending, reps)))
        _, builder, megatron_dataset, megatron_config = core

        class Tokenizer:
            vocab_size, eod, unique_identifiers = 1024, 0, {"class": "Tokenizer"}

        def theirs() -> None:
            config = megatron_config(
                random_seed=1234,
                sequence_length=2048,
                blend=([str(directory / "big")], None),
                split="1",
                tokenizer=Tokenizer(),
                reset_position_ids=False,
                reset_attention_mask=False,
                eod_mask_loss=False,
                create_attention_mask=False,
                path_to_cache=str(directory / f"megatron-{next(runs)}"),
            )
            builder(megatron_dataset, [None, None, None], lambda: True, config).build()

        rows.append(("megatron-core GPTDataset (C++ sample index)", median_time(theirs, reps)))
    lines = [
        f"GPT indices of one epoch of {documents:,} documents ({int(dataset.sequence_lengths.sum()):,} tokens, "
        "seq_length 2048), built and saved:",
        "",
        "| build | seconds | vs megatron-core |",
        "| --- | ---: | ---: |",
    ]
    for name, seconds in rows:
        ratio = f"{rows[-1][1] / seconds:.2f}x" if core else "n/a (megatron-core not importable)"
        lines.append(f"| {name} | {seconds:.2f} | {ratio} |")
    lines += ["", f"Blending index of {documents:,} samples from 2 datasets (0.3, 0.7):", ""]
    lines += ["| build | seconds | vs megatron-core |", "| --- | ---: | ---: |"]
    for name, seconds in blending:
        ratio = f"{blending[-1][1] / seconds:.3f}x" if core else "n/a (megatron-core not importable)"
        lines.append(f"| {name} | {seconds:.3f} | {ratio} |")
    return lines


def anonymous_memory_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


PER_FETCH = 16  # micro-batches a worker hands over at once in the grouped rows


class ConstantSamples(torch.utils.data.Dataset):
    """The same sample every time: what a DataLoader costs by itself."""

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        zeros = torch.zeros(32, dtype=torch.long)
        return {"tokens": zeros, "labels": zeros, "loss_mask": torch.ones(32)}


def loader_rate(dataset: torch.utils.data.Dataset, workers: int, per_fetch: int = 1, batches: int = 1000) -> float:
    """Samples/s of micro-batches of 4 from `PreTrainingDataModule`'s loader (`micro_batches_per_fetch`)."""
    from nemo_ckpt.data.pretraining import TrainingBatchCollator
    from nemo_ckpt.data.sampler import PretrainingSampler, ResumableDataLoader

    loader = ResumableDataLoader(
        dataset,
        batch_sampler=PretrainingSampler(len(dataset), 0, 4, 0, 1),
        consumed_samples=lambda: 0,
        micro_batches_per_fetch=per_fetch,
        num_workers=workers,
        collate_fn=TrainingBatchCollator(1024),
        persistent_workers=workers > 0,
    )
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * 4 / (time.perf_counter() - start)


def bench_loading(directory: Path) -> list[str]:
    from nemo_ckpt.data.pretraining import TrainingBatchCollator
    from nemo_ckpt.models import GPTModel, gpt_config
    from nemo_ckpt.optim import OptimizerConfig

    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1): one training process per core
    small = IndexedDataset(directory / "ours1_text_document")
    config = GPTDatasetConfig(seq_length=32, eod=0, path_to_cache=str(directory / "load-cache"))
    dataset = GPTDataset(small, np.arange(len(small), dtype=np.int32), 20_000, Split.train, config)
    model = GPTModel(gpt_config("tiny", vocab_size=1024), OptimizerConfig(lr=1e-3))
    model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = next(iter(torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=TrainingBatchCollator(1024))))
    for _ in range(3):
        model.loss(batch).backward()
    start = time.perf_counter()
    for _ in range(30):
        optimizer.zero_grad()
        model.loss(batch).backward()
        optimizer.step()
    training = 30 * 4 / (time.perf_counter() - start)

    loading = {
        "GPTDataset, in the training process (num_workers=0)": loader_rate(dataset, 0),
        "GPTDataset, 2 workers": loader_rate(dataset, 2),
        f"GPTDataset, 2 workers, micro_batches_per_fetch={PER_FETCH}": loader_rate(dataset, 2, PER_FETCH),
        "constant tensors, 2 workers (DataLoader's own cost)": loader_rate(ConstantSamples(), 2),
        f"constant tensors, 2 workers, micro_batches_per_fetch={PER_FETCH}": loader_rate(
            ConstantSamples(), 2, PER_FETCH
        ),
    }

    memory = []
    for prefix in (directory / "ours1_text_document", directory / "big"):
        indexed = IndexedDataset(prefix)
        samples = GPTDataset(indexed, np.arange(len(indexed), dtype=np.int32), None, Split.train, config)
        before = anonymous_memory_kib()
        for index in range(0, len(samples), max(1, len(samples) // 20_000)):
            samples[index]
        memory.append((prefix.name, int(indexed.sequence_lengths.sum()), (anonymous_memory_kib() - before) / 1024))
    lines = [
        f"Loading (seq_length 32, micro-batch 4) against the {training:,.0f} samples/s the tiny model trains on in one "
        "process (one thread):",
        "",
        "| loader | samples/s | x the tiny model's consumption |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {rate:,.0f} | {rate / training:.1f}x |" for name, rate in loading.items()]
    lines += [
        "",
        "| corpus | tokens | anonymous memory added reading 20,000 samples |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {tokens:,} | {mib:.1f} MiB |" for name, tokens, mib in memory]
    return lines


def main() -> None:
    check_dependencies(["numpy", "tokenizers"], {"megatron.core": MEGATRON_CORE_INSTALL})
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--index-documents", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        lines = bench_preprocessing(directory, args.documents, args.reps)
        lines += [""] + bench_index(directory, args.index_documents, args.reps)
        lines += [""] + bench_loading(directory)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, torch {torch.__version__}"
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    header = f"`python benchmarks/data_bench.py` on {machine}; load average at the end {load} (a shared machine)."
    section = "\n".join(["## Data", "", header, "", *lines]) + "\n"
    print(section)
    if not args.no_write:
        write_section(section)


if __name__ == "__main__":
    main()

"""Megatron-Core's `BlendedDataset`: several datasets mixed by weight, and the builder of blended splits.

The blending index is Megatron's greedy one: sample `i` comes from the dataset whose share so far lags its weight the
most, so every prefix of the blend holds each dataset's share to within one sample.
"""

import math
import os
from array import array
from collections.abc import Sequence
from numbers import Real
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from nemo_ckpt.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split, parse_split, split_documents
from nemo_ckpt.data.index_cache import load_or_build
from nemo_ckpt.data.indexed_dataset import IndexedDataset

MID_LEVEL_DATASET_SURPLUS = 0.005


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of `size` samples: the dataset it comes from (int16) and its sample number in that dataset (int64)."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    others = range(1, len(weights))
    choices = array("h", bytes(2 * size))
    for sample in range(size):
        scale = float(sample) if sample > 1 else 1.0
        chosen, largest = 0, weights[0] * scale - counts[0]
        for dataset in others:
            error = weights[dataset] * scale - counts[dataset]
            if error > largest:
                chosen, largest = dataset, error
        choices[sample] = chosen
        counts[chosen] += 1
    dataset_index = np.frombuffer(choices, dtype=np.int16).copy()
    return dataset_index, _sample_numbers(dataset_index, len(weights))


def _sample_numbers(dataset_index: np.ndarray, num_datasets: int) -> np.ndarray:
    """For each position, how many earlier positions chose the same dataset."""
    dataset_sample_index = np.zeros(len(dataset_index), dtype=np.int64)
    for dataset in range(num_datasets):
        positions = np.flatnonzero(dataset_index == dataset)
        dataset_sample_index[positions] = np.arange(len(positions))
    return dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Exactly `sizes[i]` samples of dataset `i`, interleaved by the same greedy rule (exhausted datasets drop out)."""
    total = int(sum(sizes))
    dataset_index = np.zeros(total, dtype=np.int16)
    dataset_sample_index = np.zeros(total, dtype=np.int64)
    weights = [size / float(total) for size in sizes]
    counts = [0] * len(sizes)
    unspent = [i for i, size in enumerate(sizes) if size > 0]
    for sample in range(total):
        scale = max(float(sample), 1.0)
        chosen = max(unspent, key=lambda i: (weights[i] * scale - counts[i], -i))
        dataset_index[sample] = chosen
        dataset_sample_index[sample] = counts[chosen]
        counts[chosen] += 1
        if counts[chosen] == sizes[chosen]:
            unspent.remove(chosen)
    return dataset_index, dataset_sample_index


class BlendedDataset(Dataset):
    """`size` samples drawn from `datasets` in proportion to `weights` (normalised); with `size=None`, exactly
    `weights[i]` samples (integers) of dataset `i`."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float],
        size: int | None,
        path_to_cache: str | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if any(w <= 0 for w in weights):
            raise ValueError(f"BlendedDataset: weights must be positive, got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = [float(w) / sum(weights) for w in weights] if size is not None else [int(w) for w in weights]
        self.size = size if size is not None else sum(self.weights)
        description = {
            "class": type(self).__name__,
            "datasets": [getattr(d, "description", repr(d)) for d in self.datasets],
            "weights": self.weights,
            "size": size,
        }
        self.dataset_index, self.dataset_sample_index = load_or_build(
            path_to_cache,
            type(self).__name__,
            description,
            ("dataset_index", "dataset_sample_index"),
            lambda: (
                build_blending_indices(self.weights, size)
                if size is not None
                else build_exhaustive_blending_indices(self.weights)
            ),
        )
        used = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for number, (dataset, needed) in enumerate(zip(self.datasets, used)):
            if len(dataset) < needed:
                raise ValueError(
                    f"BlendedDataset: the blend takes {needed} samples from dataset {number}, which has {len(dataset)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        dataset_id = int(self.dataset_index[index])
        sample = self.datasets[dataset_id][int(self.dataset_sample_index[index])]
        return {"dataset_id": torch.tensor(dataset_id), **sample}


def parse_blend(paths: str | Path | Sequence) -> tuple[list[str], list[float] | None]:
    """NeMo's `paths`: one prefix, a list of prefixes, or `[weight, prefix, weight, prefix, ...]`."""
    if isinstance(paths, (str, Path)):
        return [str(paths)], None
    items = list(paths)
    if not items:
        raise ValueError("paths is empty: give one or more indexed-dataset path prefixes")

    def is_weight(item) -> bool:
        if isinstance(item, Real):
            return True
        try:
            float(item)
            return True
        except (TypeError, ValueError):
            return False

    if not any(is_weight(item) for item in items):
        return [str(item) for item in items], None
    pairs_ok = len(items) % 2 == 0 and all(
        is_weight(items[i]) and not is_weight(items[i + 1]) for i in range(0, len(items), 2)
    )
    if not pairs_ok:
        raise ValueError(
            f"paths={items!r}: a weighted blend alternates weight and path prefix, e.g. [0.3, 'a', 0.7, 'b']"
        )
    weights = [float(items[i]) for i in range(0, len(items), 2)]
    if any(w <= 0 for w in weights):
        raise ValueError(f"paths={items!r}: blend weights must be positive")
    return [str(items[i]) for i in range(1, len(items), 2)], weights


def blend_cache(prefixes: Sequence[str], config: GPTDatasetConfig) -> str:
    """Where a blend's indices are cached: `path_to_cache`, else next to its first dataset."""
    return config.path_to_cache or os.path.join(prefixes[0], "cache", f"{BlendedDataset.__name__}_indices")


def _sizes_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def build_split_dataset(
    prefixes: Sequence[str],
    weights: Sequence[float] | None,
    split: str,
    which: Split,
    num_samples: int | None,
    config: GPTDatasetConfig,
) -> Dataset | None:
    """The `which` split of the blend, as Megatron-Core's `BlendedMegatronDatasetBuilder` builds it; None when the
    split's weight is 0. `num_samples=None` is one epoch of each dataset."""
    bookends = parse_split(split)[which.value]
    if bookends is None:
        return None
    indexed = [IndexedDataset(prefix) for prefix in prefixes]

    def split_dataset(dataset: IndexedDataset, samples: int | None) -> GPTDataset:
        return GPTDataset(dataset, split_documents(len(dataset), bookends), samples, which, config)

    if len(prefixes) == 1 and weights is None:
        return split_dataset(indexed[0], num_samples)
    if weights is None:
        datasets = [split_dataset(dataset, None) for dataset in indexed]
        lengths = [len(d) for d in datasets]
        size = None if num_samples is None else min(num_samples, sum(lengths))
        return BlendedDataset(datasets, lengths, size, blend_cache(prefixes, config))
    if num_samples is None:
        raise ValueError("A weighted blend needs a number of samples for each split it builds")
    total = float(sum(weights))
    weights = [w / total for w in weights]
    buffered = _sizes_per_dataset(weights, num_samples, MID_LEVEL_DATASET_SURPLUS)
    datasets = [split_dataset(dataset, samples) for dataset, samples in zip(indexed, buffered)]
    size = sum(_sizes_per_dataset(weights, num_samples))
    return BlendedDataset(datasets, weights, size, blend_cache(prefixes, config))

"""`BlendedDataset`: Megatron's blending index, weighted and size-proportional blends, and blend parsing."""

import numpy as np
import pytest

from nemo_ckpt.data.blended_dataset import (
    build_blending_indices,
    build_exhaustive_blending_indices,
    build_split_dataset,
    parse_blend,
)
from nemo_ckpt.data.gpt_dataset import GPTDatasetConfig, Split
from tests.data.test_gpt_dataset import make_dataset


def test_every_prefix_holds_each_share_within_one_sample():
    weights = [0.2, 0.5, 0.3]
    dataset_index, sample_index = build_blending_indices(weights, 1000)
    counts = np.zeros(3)
    for position, dataset in enumerate(dataset_index):
        assert sample_index[position] == counts[dataset]  # each dataset's samples in order
        counts[dataset] += 1
        assert np.all(np.abs(counts - np.array(weights) * (position + 1)) <= 1.0)
    assert counts.tolist() == [200, 500, 300]


def test_exhaustive_blend_takes_exactly_each_size():
    dataset_index, sample_index = build_exhaustive_blending_indices([3, 10, 1])
    assert np.bincount(dataset_index).tolist() == [3, 10, 1]
    assert sorted(sample_index[dataset_index == 1].tolist()) == list(range(10))


def test_parse_blend():
    assert parse_blend("a") == (["a"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend([0.3, "a", "70", "b"]) == (["a", "b"], [0.3, 70.0])
    with pytest.raises(ValueError, match="alternates weight and path prefix"):
        parse_blend([0.3, "a", "b"])
    with pytest.raises(ValueError, match="alternates weight and path prefix"):
        parse_blend(["a", 0.3, "b", 0.7])
    with pytest.raises(ValueError, match="must be positive"):
        parse_blend([0, "a", 1, "b"])


def test_weighted_blend_of_two_datasets(tmp_path):
    make_dataset(tmp_path / "a", seed=0)
    make_dataset(tmp_path / "b", seed=1)
    config = GPTDatasetConfig(seq_length=8, eod=0, path_to_cache=str(tmp_path / "cache"))
    prefixes = [str(tmp_path / "a"), str(tmp_path / "b")]
    blend = build_split_dataset(prefixes, [1.0, 3.0], "90,10,0", Split.train, 400, config)
    assert len(blend) == 400
    assert np.bincount(blend.dataset_index).tolist() == [100, 300]
    assert build_split_dataset(prefixes, [1.0, 3.0], "90,10,0", Split.test, 40, config) is None
    sample = blend[0]
    assert sample["dataset_id"].item() == 1 and sample["tokens"].shape == (8,)
    by_size = build_split_dataset(prefixes, None, "90,10,0", Split.valid, None, config)
    assert len(by_size) == sum(len(d) for d in by_size.datasets)

"""Indexed datasets and GPT samples identical to megatron-core's, both directions.

Runs against megatron-core 0.19.2 as `tests/install_megatron_core.sh` installs it (as CI does); skipped without it.
"""

import numpy as np
import pytest
import torch

from tests.helpers.megatron import importorskip_megatron_core

importorskip_megatron_core("megatron.core.datasets.gpt_dataset")

from megatron.core.datasets import indexed_dataset as megatron_indexed  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MegatronGPTDatasetConfig  # noqa: E402

from nemo_ckpt.data.blended_dataset import build_split_dataset  # noqa: E402
from nemo_ckpt.data.gpt_dataset import GPTDatasetConfig, Split  # noqa: E402
from nemo_ckpt.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402

EOD = 0


class Tokenizer:
    """What megatron-core's GPTDatasetConfig reads of a tokenizer."""

    vocab_size = 1000
    eod = EOD
    unique_identifiers = {"class": "Tokenizer", "vocab_size": 1000}


def documents(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.r_[rng.integers(1, 1000, int(rng.integers(1, 60))), EOD] for _ in range(count)]


def write_ours(prefix, docs) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_each_reads_the_others_files(tmp_path):
    docs = documents(0, 50)
    ours = IndexedDataset(write_ours(tmp_path / "ours", docs))
    theirs_reading_ours = megatron_indexed.IndexedDataset(str(tmp_path / "ours"))
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for doc in docs:
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    assert (tmp_path / "theirs.idx").read_bytes() == (tmp_path / "ours.idx").read_bytes()
    assert (tmp_path / "theirs.bin").read_bytes() == (tmp_path / "ours.bin").read_bytes()
    ours_reading_theirs = IndexedDataset(tmp_path / "theirs")
    for index in range(len(docs)):
        assert ours[index].tolist() == theirs_reading_ours[index].tolist() == ours_reading_theirs[index].tolist()
        assert ours.get(index, 1, 2).tolist() == theirs_reading_ours.get(index, 1, 2).tolist()
    assert np.array_equal(ours.document_indices, theirs_reading_ours.document_indices)


@pytest.mark.parametrize(
    "weights, split, sizes",
    [
        (None, "1", [None, None, None]),  # one epoch
        (None, "1", [2000, None, None]),  # several epochs, the last one shuffled separately
        ([0.3, 0.7], "90,8,2", [600, 40, 10]),  # a weighted blend of two datasets, split three ways
    ],
)
def test_same_samples_in_the_same_order(tmp_path, weights, split, sizes):
    prefixes = [write_ours(tmp_path / "a", documents(1, 150)), write_ours(tmp_path / "b", documents(2, 90))]
    prefixes = prefixes if weights else prefixes[:1]
    megatron_config = MegatronGPTDatasetConfig(
        random_seed=5,
        sequence_length=16,
        blend=(prefixes, weights),
        split=split,
        tokenizer=Tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
        create_attention_mask=False,
        path_to_cache=str(tmp_path / "megatron-cache"),
    )
    theirs = BlendedMegatronDatasetBuilder(MegatronGPTDataset, sizes, lambda: True, megatron_config).build()
    config = GPTDatasetConfig(
        seq_length=16, eod=EOD, random_seed=5, eod_mask_loss=True, path_to_cache=str(tmp_path / "c")
    )
    for which in Split:
        if theirs[which.value] is None:
            assert build_split_dataset(prefixes, weights, split, which, sizes[which.value], config) is None
            continue
        ours = build_split_dataset(prefixes, weights, split, which, sizes[which.value], config)
        assert len(ours) == len(theirs[which.value])
        for index in range(len(ours)):
            mine, megatron = ours[index], theirs[which.value][index]
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                assert torch.equal(mine[key], megatron[key]), (which, index, key)

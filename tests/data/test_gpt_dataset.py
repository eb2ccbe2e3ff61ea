"""`GPTDataset`: windows of the shuffled document stream, splits by document, epochs, cached indices, masks."""

import numpy as np
import pytest
import torch

from nemo_ckpt.data import gpt_dataset
from nemo_ckpt.data.gpt_dataset import GPTDataset, GPTDatasetConfig, Split, parse_split, split_documents
from nemo_ckpt.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from tests.helpers.distributed import run_distributed

EOD = 0


def make_dataset(prefix, num_documents=100, seed=0) -> IndexedDataset:
    """Document d holds tokens 1000 + d (then an EOD), so each token names its document."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for document in range(num_documents):
        length = int(rng.integers(1, 20))
        builder.add_document([1000 + document] * length + [EOD], [length + 1])
    builder.finalize(f"{prefix}.idx")
    return IndexedDataset(prefix)


def config(tmp_path, **overrides) -> GPTDatasetConfig:
    return GPTDatasetConfig(**{"seq_length": 16, "eod": EOD, "path_to_cache": str(tmp_path / "cache"), **overrides})


def stream(dataset: GPTDataset) -> np.ndarray:
    return np.concatenate([dataset.dataset[int(d)] for d in dataset.document_index])


def test_samples_are_overlapping_windows_of_the_shuffled_stream(tmp_path):
    indexed = make_dataset(tmp_path / "d")
    dataset = GPTDataset(indexed, np.arange(100, dtype=np.int32), None, Split.train, config(tmp_path))
    tokens = stream(dataset)
    assert len(dataset) == (len(tokens) - 1) // 16
    assert sorted(dataset.document_index.tolist()) == list(range(100))
    assert sorted(dataset.shuffle_index.tolist()) == list(range(len(dataset)))
    for index in (0, 1, len(dataset) - 1):
        window = int(dataset.shuffle_index[index]) * 16
        assert dataset.sample_tokens(index).tolist() == tokens[window : window + 17].tolist()
        sample = dataset[index]
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        assert sample["tokens"].shape == (16,) and sample["loss_mask"].tolist() == [1.0] * 16


def test_several_epochs_repeat_every_document(tmp_path):
    indexed = make_dataset(tmp_path / "d")
    one_epoch = GPTDataset(indexed, np.arange(100, dtype=np.int32), None, Split.train, config(tmp_path))
    requested = 3 * len(one_epoch) + len(one_epoch) // 2
    dataset = GPTDataset(indexed, np.arange(100, dtype=np.int32), requested, Split.train, config(tmp_path))
    assert dataset.num_epochs == 4 and len(dataset) >= requested
    assert np.bincount(dataset.document_index).tolist() == [4] * 100
    last_epoch = dataset.document_index[300:]  # shuffled on its own: the final epoch is only half used
    assert sorted(last_epoch.tolist()) == list(range(100))


def test_split_by_documents(tmp_path):
    indexed = make_dataset(tmp_path / "d")
    bookends = parse_split("969,30,1")
    assert np.allclose(bookends, [(0, 0.969), (0.969, 0.999), (0.999, 1.0)])
    assert parse_split("8,2")[2] is None
    documents = [split_documents(100, ends) for ends in parse_split("80,15,5")]
    assert [(d[0], d[-1]) for d in documents] == [(0, 79), (80, 94), (95, 99)]
    valid = GPTDataset(indexed, documents[1], None, Split.valid, config(tmp_path))
    seen = {int(t) - 1000 for i in range(len(valid)) for t in valid.sample_tokens(i) if t != EOD}
    assert seen <= set(range(80, 95))


def test_indices_are_cached_by_config_hash(tmp_path, monkeypatch):
    indexed = make_dataset(tmp_path / "d")
    first = GPTDataset(indexed, np.arange(100, dtype=np.int32), None, Split.train, config(tmp_path))
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 4 and all(name.split("-")[1:3] == ["GPTDataset", "train"] for name in files)

    def no_rebuild(*args):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(gpt_dataset, "build_sample_index", no_rebuild)
    again = GPTDataset(indexed, np.arange(100, dtype=np.int32), None, Split.train, config(tmp_path))
    assert np.array_equal(first.shuffle_index, again.shuffle_index)
    with pytest.raises(AssertionError, match="rebuilt"):
        GPTDataset(indexed, np.arange(100, dtype=np.int32), None, Split.train, config(tmp_path, random_seed=7))


def test_default_cache_lives_next_to_the_data(tmp_path):
    indexed = make_dataset(tmp_path / "d")
    GPTDataset(indexed, np.arange(100, dtype=np.int32), None, Split.train, config(tmp_path, path_to_cache=None))
    assert len(list((tmp_path / "d" / "cache" / "GPTDataset_indices").glob("*.npy"))) == 3


def test_eod_mask_and_reset_position_ids(tmp_path):
    indexed = make_dataset(tmp_path / "d")
    options = {"eod_mask_loss": True, "reset_position_ids": True, "create_attention_mask": True}
    options["reset_attention_mask"] = True
    dataset = GPTDataset(indexed, np.arange(100, dtype=np.int32), None, Split.train, config(tmp_path, **options))
    sample = dataset[0]
    eods = (sample["tokens"] == EOD).nonzero().flatten().tolist()
    assert eods, "a 16-token window of documents shorter than 20 tokens holds an EOD"
    assert sample["loss_mask"][eods].tolist() == [0.0] * len(eods)
    first = eods[0]
    assert sample["position_ids"][first + 1].item() == 0
    assert sample["attention_mask"][0, first + 1, first].item() is True  # masked: across the document boundary
    assert sample["attention_mask"][0, first, first].item() is False


def test_seq_length_longer_than_the_data_is_a_clear_error(tmp_path):
    indexed = make_dataset(tmp_path / "d", num_documents=3)
    with pytest.raises(ValueError, match=r"train split of .*d \(3 documents\) holds \d+ tokens, fewer than one sample"):
        GPTDataset(indexed, np.arange(3, dtype=np.int32), None, Split.train, config(tmp_path, seq_length=4096))


def _build_on_ranks(rank: int, world_size: int, prefix: str, cache: str) -> list[int]:
    dataset = GPTDataset(
        IndexedDataset(prefix),
        np.arange(100, dtype=np.int32),
        500,
        Split.train,
        GPTDatasetConfig(16, EOD, path_to_cache=cache),
    )
    return dataset.shuffle_index[:20].tolist()


def test_rank_zero_builds_and_the_others_load(tmp_path):
    make_dataset(tmp_path / "d")
    orders = run_distributed(_build_on_ranks, 2, str(tmp_path / "d"), str(tmp_path / "cache"))
    assert orders[0] == orders[1]
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 3
    assert not list((tmp_path / "cache").glob(".*tmp*"))


def test_unwritable_cache_names_the_option(tmp_path):
    indexed = make_dataset(tmp_path / "d")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OSError, match=r"Cannot write the GPTDataset-train index files .*index_mapping_dir"):
        GPTDataset(
            indexed,
            np.arange(100, dtype=np.int32),
            None,
            Split.train,
            config(tmp_path, path_to_cache=str(tmp_path / "file" / "cache")),
        )

"""`PreTrainingDataModule`: configuration errors up front, batches for `GPTModel`, resuming at consumed samples."""

from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from nemo_ckpt.data.pretraining import PreTrainingDataModule
from nemo_ckpt.data.sampler import ResumableDataLoader
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.models import GPTModel, gpt_config
from tests.data.test_gpt_dataset import make_dataset
from tests.helpers.trainer import build_trainer


@pytest.fixture
def prefixes(tmp_path):
    return [str(make_dataset(tmp_path / name, seed=seed).path_prefix) for seed, name in enumerate("ab")]


class DocumentIds(ByteLevelTokenizer):
    """The ids of `make_dataset`'s documents (1000 + document index) are among its tokens."""

    vocab_size = 1100


def module(paths, **overrides) -> PreTrainingDataModule:
    options = {"seq_length": 8, "tokenizer": DocumentIds(), "micro_batch_size": 2, "global_batch_size": 2}
    return PreTrainingDataModule(paths, **{**options, "num_workers": 0, "split": "90,10,0", **overrides})


def attach(data: PreTrainingDataModule, max_steps: int = 10) -> pl.Trainer:
    """A Trainer before `fit` (global step 0); resuming at a later step is `tests/data/test_real_data_resume.py`."""
    trainer = build_trainer(max_steps=max_steps, val_check_interval=5, limit_val_batches=2)
    data.trainer = trainer
    return trainer


def test_batches_fit_gpt_training_step(prefixes):
    data = module(prefixes[0])
    attach(data)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) >= 10
    batch = batches[0]
    assert sorted(batch) == ["labels", "loss_mask", "tokens"]
    assert batch["tokens"].shape == batch["labels"].shape == (2, 8) and batch["tokens"].dtype == torch.long
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    model = GPTModel(gpt_config("tiny", vocab_size=1100, seq_length=8))
    model.configure_model()
    assert torch.isfinite(model.loss(batch))
    assert len(list(data.val_dataloader())) >= 2


def test_resumes_after_consumed_samples(prefixes):
    fresh = module(prefixes[0])
    attach(fresh)
    fresh.setup("fit")
    reference = [batch["tokens"] for batch in fresh.train_dataloader()]

    resumed = module(prefixes[0])
    resumed.load_state_dict({"consumed_samples": 6})  # what Lightning restores from a checkpoint's datamodule entry
    attach(resumed)
    resumed.setup("fit")
    loader = resumed.train_dataloader()
    assert isinstance(loader, ResumableDataLoader)
    assert loader.state_dict() == {"consumed_samples": 6} == {"consumed_samples": resumed.consumed_samples()}
    assert torch.equal(next(iter(loader))["tokens"], reference[3])
    loader.load_state_dict({"consumed_samples": 8})  # what Lightning restores from the fit loop's loader state
    assert torch.equal(next(iter(loader))["tokens"], reference[4])


def test_fetching_several_micro_batches_at_once_gives_the_same_micro_batches(prefixes):
    """micro_batches_per_fetch=4 with 2 workers: the same micro-batches in the same order (a last, incomplete
    group included), as many of them, and a resume at consumed samples that do not start a group."""
    fresh = module(prefixes[0])
    attach(fresh)
    fresh.setup("fit")
    reference = list(fresh.train_dataloader())
    grouped = module(prefixes[0], micro_batches_per_fetch=4, num_workers=2)
    attach(grouped)
    grouped.setup("fit")
    loader = grouped.train_dataloader()
    batches = list(loader)
    assert len(loader) == len(reference) == len(batches) and len(reference) % 4
    for ours, theirs in zip(batches, reference):
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    loader.load_state_dict({"consumed_samples": 6})  # micro-batch 3: inside the first group of 4
    resumed = list(loader)
    assert len(resumed) == len(reference) - 3
    assert all(torch.equal(ours["tokens"], theirs["tokens"]) for ours, theirs in zip(resumed, reference[3:]))
    with pytest.raises(ValueError, match=r"micro_batches_per_fetch=0; use 1 or more"):
        module(prefixes[0], micro_batches_per_fetch=0)


def test_weighted_blend(prefixes):
    data = module([0.25, prefixes[0], 0.75, prefixes[1]])
    attach(data, max_steps=20)
    data.setup("fit")
    blend = data.datasets[next(iter(data.datasets))]
    assert len(blend) == 40 and np.bincount(blend.dataset_index).tolist() == [10, 30]
    assert len(list(Path(prefixes[0], "cache", "BlendedDataset_indices").glob("*.npy"))) == 4  # train and valid


def test_one_blend_per_split(prefixes):
    data = module({"train": prefixes[0], "validation": [1, prefixes[0], 1, prefixes[1]]})
    attach(data)
    data.setup("fit")
    train, valid = data.datasets.values()
    assert train.document_ids.tolist() == list(range(100))  # all of dataset a, no split
    assert sorted(set(valid.dataset_index.tolist())) == [0, 1]
    assert len(valid) == (10 // 5 + 1) * 2 * 2  # NeMo's validation size: checks x limit_val_batches x batch


class LargeVocabulary(ByteLevelTokenizer):
    vocab_size = 100_000


def test_bad_configuration_is_refused_before_training(prefixes, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.idx does not exist"):
        module(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="alternates weight and path prefix"):
        module([0.5, prefixes[0], prefixes[1]])
    with pytest.raises(ValueError, match="reset_position_ids"):
        module(prefixes[0], reset_position_ids=True)
    with pytest.raises(ValueError, match=r"unknown split keys \['training'\]"):
        module({"training": prefixes[0]})
    with pytest.raises(FileNotFoundError, match="does not exist: pass a local directory"):
        module(prefixes[0], tokenizer=str(tmp_path / "no-tokenizer"))


def test_ids_beyond_the_tokenizer_are_refused_up_front_and_in_every_batch(prefixes):
    with pytest.raises(ValueError, match=r"/a holds token id 10\d\d, but the tokenizer has 257 tokens"):
        module(prefixes[0], tokenizer="byte-level")
    data = module(prefixes[0])
    attach(data)
    data.setup("fit")
    data.tokenizer = ByteLevelTokenizer()  # past the up-front check, which reads the first MiB of tokens only
    with pytest.raises(ValueError, match=r"the data holds token id 10\d\d, but its tokenizer has 257 tokens"):
        next(iter(data.train_dataloader()))


def test_vocabulary_larger_than_the_token_dtype_is_refused(tmp_path):
    from nemo_ckpt.data.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(tmp_path / "small.bin", np.uint16)
    builder.add_document(list(range(1, 50)), [49])
    builder.finalize(tmp_path / "small.idx")
    with pytest.raises(
        ValueError, match=r"small: its tokens are uint16 \(ids below 65536\) but the tokenizer has 100000"
    ):
        module(str(tmp_path / "small"), tokenizer=LargeVocabulary())

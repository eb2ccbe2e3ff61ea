"""The generated corpus of the real-data recipes: prepared once, tokenized to fit the model, used by the recipe."""

import math

import fiddle as fdl
import pytest

from nemo_ckpt.data.corpus import unigram_entropy
from nemo_ckpt.data.indexed_dataset import IndexedDataset
from nemo_ckpt.data.pretraining import PreTrainingDataModule
from nemo_ckpt.models import gpt_config
from recipes import pretrain_recipe


def test_real_data_recipe_prepares_the_corpus_once(tmp_path):
    recipe = pretrain_recipe(name="real", dir=str(tmp_path), num_gpus_per_node=1, data="real")
    data = fdl.build(recipe.data)
    assert isinstance(data, PreTrainingDataModule)
    prefix = tmp_path / "data" / "tiny_corpus" / "corpus_text_document"
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 2000 and dataset.num_documents == 2000
    assert recipe.model.config.vocab_size is None  # the model takes the tokenizer's, padded: the preset's size
    assert data.tokenizer.vocab_size <= gpt_config("tiny").vocab_size
    assert all(sequence[-1] == data.tokenizer.eod for sequence in dataset[0:10])
    entropy = unigram_entropy(prefix)
    assert 1.0 < entropy < math.log(data.tokenizer.vocab_size)

    written = prefix.with_suffix(".bin").stat().st_mtime_ns
    fdl.build(recipe.data)
    assert prefix.with_suffix(".bin").stat().st_mtime_ns == written


def test_real_data_recipe_options_are_checked():
    with pytest.raises(ValueError, match="data='bogus': choose 'mock' or 'real'"):
        pretrain_recipe(data="bogus")
    with pytest.raises(ValueError, match="needs tokenizer="):
        pretrain_recipe(data="real", data_paths=["/data/a_text_document"])
    with pytest.raises(ValueError, match="brings its own tokenizer"):
        pretrain_recipe(data="real", tokenizer="byte-level")

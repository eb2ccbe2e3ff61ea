"""The GPT's vocabulary comes from the tokenizer by default, padded to `make_vocab_size_divisible_by` (Megatron's
rule); a set vocabulary smaller than the tokenizer's is refused with both numbers and the fix."""

import json
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import load_model
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.checkpoint.manifest import Manifest
from nemo_ckpt.data.preprocess import main as preprocess
from nemo_ckpt.models.gpt.model import GPT, VocabularyError, gpt_config, padded_vocab_size, with_vocab_of
from recipes import pretrain_recipe
from tests.helpers.distributed import run_distributed
from tests.helpers.recipe import checkpoint_dir, train


def test_vocabulary_from_the_tokenizer_is_padded_and_a_smaller_one_is_refused():
    config = gpt_config("tiny", vocab_size=None)
    assert padded_vocab_size(257, 128) == 384 and padded_vocab_size(256, 128) == 256
    assert with_vocab_of(config, 257, "byte-level").vocab_size == 384
    by_eight = gpt_config("tiny", vocab_size=None, make_vocab_size_divisible_by=8)
    assert with_vocab_of(by_eight, 257, "x").vocab_size == 264
    assert with_vocab_of(gpt_config("tiny", vocab_size=300), 257, "x").vocab_size == 300  # a set size that fits stays
    message = (
        r"model.config.vocab_size=256 is smaller than the 257 token ids of the tokenizer byte-level.*"
        r"model.config.vocab_size=None to take the tokenizer's \(384, padded to a multiple of "
        r"make_vocab_size_divisible_by=128\), or a size >= 257"
    )
    with pytest.raises(VocabularyError, match=message):
        with_vocab_of(gpt_config("tiny"), 257, "the tokenizer byte-level")
    with pytest.raises(VocabularyError, match="vocab_size=None is taken from the tokenizer"):
        GPT(config)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by=0"):
        gpt_config("tiny", make_vocab_size_divisible_by=0)


def byte_level_corpus(directory: Path) -> str:
    """The README's byte-level corpus: 1,000 short documents, preprocessed with --append-eod (ids 0-256)."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i} says hello."}) + "\n" for i in range(1000)))
    prefix = directory / "corpus"
    args = ["--input", str(corpus), "--json-keys", "text", "--tokenizer", "byte-level", "--output-prefix", str(prefix)]
    assert preprocess([*args, "--append-eod"]) == 0
    return f"{prefix}_text_document"


def train_on_bytes(rank: int, world_size: int, root: str, data_prefix: str) -> None:
    recipe = pretrain_recipe(data_paths=[data_prefix], tokenizer="byte-level")  # the tiny model, vocab_size None
    train(Path(root), 2, world_size, every_n_train_steps=2, overrides={"data": recipe.data})


def test_byte_level_data_trains_the_tiny_recipe_with_the_padded_vocabulary(tmp_path):
    prefix = byte_level_corpus(tmp_path / "data")
    run_distributed(train_on_bytes, 2, str(tmp_path / "runs"), prefix)
    directory = checkpoint_dir(tmp_path / "runs")
    [record] = Manifest.read(directory).checkpoints
    tensors = dist_checkpointing.load_plain_tensors(weights_dir(directory / record.name))
    assert tensors["module.embedding.weight"].shape == (384, 64)  # 257 byte-level ids, padded to 3 x 128
    model = load_model(directory / record.name)  # the stored config records the size used
    assert model.config.vocab_size == 384
    assert torch.equal(model.module.embedding.weight, tensors["module.embedding.weight"])

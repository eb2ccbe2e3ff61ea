"""`evaluate`: a checkpoint's loss and perplexity on an indexed dataset and on SFT records equal what the training
loop's validation logs on the same data (`trainer.validate`); token-weighted loss and perplexity; bad input named,
also through `nemo nemo_ckpt evaluate`."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.context import load_model, save_context
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir, weights_dir
from nemo_ckpt.data.indexed_dataset import IndexedDatasetBuilder
from nemo_ckpt.data.pretraining import PreTrainingDataModule
from nemo_ckpt.data.sft import FineTuningDataModule
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.dist_checkpointing import ShardedTensor
from nemo_ckpt.inference.evaluate import eval_dataset, evaluate
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.models.gpt.model import VocabularyError
from tests.helpers import commands
from tests.helpers.trainer import build_trainer

SEQ_LENGTH = 16
TEXTS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 3 + 1) for i in range(12)]
RECORDS = [{"input": f"What is {i} + {i}?", "output": f"It is {2 * i}." + " Sure." * (i % 3)} for i in range(7)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random tiny GPT over byte-level ids, saved with its tokenizer in context/hf."""
    path = tmp_path_factory.mktemp("evaluate") / "ckpt"
    torch.manual_seed(0)
    model = GPTModel(gpt_config("tiny", vocab_size=257, seq_length=SEQ_LENGTH))
    model.configure_model()
    weights_dir(path).mkdir(parents=True)
    state = {
        key: ShardedTensor.from_rank_offsets(key, value, replica_id=0) for key, value in model.state_dict().items()
    }
    dist_checkpointing.save({"state_dict": state}, weights_dir(path))
    save_context(path, model=model, data=SimpleNamespace(tokenizer=ByteLevelTokenizer()))
    return path


def write_indexed(prefix: Path, documents: list[list[int]]) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    for ids in documents:
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def indexed(checkpoint) -> str:
    tokenizer = ByteLevelTokenizer()
    return write_indexed(checkpoint.parent / "corpus", [tokenizer.text_to_ids(t) + [tokenizer.eod] for t in TEXTS])


@pytest.fixture(scope="module")
def sft_root(checkpoint) -> Path:
    root = checkpoint.parent / "sft"
    root.mkdir()
    lines = "".join(json.dumps(record) + "\n" for record in RECORDS)
    for name in ("training.jsonl", "validation.jsonl"):
        (root / name).write_text(lines)
    return root


def validation_loss(checkpoint: Path, data) -> float:
    """What the training loop's validation logs as val_loss for `data` (every validation batch)."""
    trainer = build_trainer(max_steps=1, limit_val_batches=1.0)
    [metrics] = trainer.validate(load_model(checkpoint), datamodule=data, verbose=False)
    return metrics["val_loss"]


def test_indexed_dataset_loss_is_the_validation_loss_and_token_weighted(checkpoint, indexed):
    result = evaluate(str(checkpoint), indexed, micro_batch_size=4)
    data = PreTrainingDataModule(
        {"validation": indexed}, SEQ_LENGTH, ByteLevelTokenizer(), 4, global_batch_size=None, num_workers=0
    )
    assert result.val_loss == pytest.approx(validation_loss(checkpoint, data), abs=1e-5)
    # every token of every sample, each weighing the same: the cross entropy of all of them at once
    dataset = eval_dataset(indexed, ByteLevelTokenizer(), SEQ_LENGTH, 1234, "", "", None)
    tokens = torch.stack([dataset[i]["tokens"] for i in range(len(dataset))])
    labels = torch.stack([dataset[i]["labels"] for i in range(len(dataset))])
    with torch.no_grad():
        expected = F.cross_entropy(load_model(checkpoint)(tokens).flatten(0, 1), labels.flatten())
    assert result.samples == len(dataset) and result.tokens == len(dataset) * SEQ_LENGTH
    assert result.loss == pytest.approx(float(expected), abs=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.loss), rel=1e-12)
    if len(dataset) % 4 == 0:  # every sample in whole micro-batches: the same mean
        assert result.loss == pytest.approx(result.val_loss, abs=1e-5)


def test_sft_records_loss_is_the_validation_loss_on_answer_tokens(checkpoint, sft_root):
    data_file = str(sft_root / "validation.jsonl")
    result = evaluate(str(checkpoint), data_file, micro_batch_size=2)
    data = FineTuningDataModule(
        str(sft_root), str(hf_artifacts_dir(checkpoint)), SEQ_LENGTH, micro_batch_size=2, global_batch_size=None
    )
    assert result.val_loss == pytest.approx(validation_loss(checkpoint, data), abs=1e-5)
    # token-weighted over all 7 records (validation leaves the 7th out: 3 micro-batches of 2)
    model = load_model(checkpoint)
    dataset = eval_dataset(data_file, ByteLevelTokenizer(), SEQ_LENGTH, 1234, "{input}\n", "", None)
    assert result.samples == len(RECORDS) == len(dataset)
    losses, counts = [], []
    with torch.no_grad():
        for sample in (dataset[i] for i in range(len(dataset))):
            per_token = F.cross_entropy(model(sample["tokens"][None])[0], sample["labels"], reduction="none")
            losses.append(float((per_token * sample["loss_mask"]).sum()))
            counts.append(int(sample["loss_mask"].sum()))
    assert 0 < result.tokens == sum(counts) < len(RECORDS) * SEQ_LENGTH  # prompts are not scored
    assert result.loss == pytest.approx(sum(losses) / sum(counts), abs=1e-5)
    assert result.loss != pytest.approx(result.val_loss, abs=1e-4)  # answers differ in length: a different mean


def test_bad_input_is_named(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.bin and .*nowhere\.idx missing; pass an indexed"):
        evaluate(str(checkpoint), str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no such JSONL file"):
        evaluate(str(checkpoint), str(tmp_path / "nowhere.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "no input/output"}\n')
    with pytest.raises(ValueError, match=r'bad\.jsonl:1: a record needs "input" and "output"'):
        evaluate(str(checkpoint), str(tmp_path / "bad.jsonl"))
    large = write_indexed(tmp_path / "large", [[300] * 40])
    with pytest.raises(VocabularyError, match="holds token id 300, but the model's vocabulary has 257 ids"):
        evaluate(str(checkpoint), large)


def test_prints_loss_and_the_command_line_refuses_bad_input(checkpoint, indexed, tmp_path, capsys):
    result = evaluate(str(checkpoint), indexed)
    printed = capsys.readouterr().out
    assert printed.startswith(f"evaluate: {checkpoint} on {indexed}\n  loss {result.loss:.6f}, perplexity ")
    assert f"({result.tokens:,} tokens, {result.samples:,} samples)\n  val_loss {result.val_loss:.6f}" in printed
    missing = commands.nemo("nemo_ckpt", "evaluate", f"path={checkpoint}", f"data={tmp_path / 'x.jsonl'}", cwd=tmp_path)
    assert missing.returncode == 1 and "no such JSONL file" in missing.stdout, missing.stdout


def test_seq_length_sets_where_samples_are_cut(checkpoint, sft_root):
    cut = evaluate(str(checkpoint), str(sft_root / "validation.jsonl"))  # the model's 16 tokens: answers cut
    whole = evaluate(str(checkpoint), str(sft_root / "validation.jsonl"), seq_length=40)
    assert cut.samples == whole.samples and cut.tokens < whole.tokens

"""`RestoreConfig(load_artifacts=True)`: fine-tuning tokenizes with the tokenizer stored in the restored checkpoint
(an imported Hugging Face model's `context/hf`), as NeMo restores the model's tokenizer from the checkpoint."""

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nemo_ckpt.api import finetune, import_ckpt  # noqa: E402
from nemo_ckpt.checkpoint.layout import hf_artifacts_dir  # noqa: E402
from nemo_ckpt.checkpoint.resume import AutoResume, RestoreConfig, restore_artifacts  # noqa: E402
from nemo_ckpt.data.sft import FineTuningDataModule  # noqa: E402
from nemo_ckpt.data.tokenizer import get_tokenizer, train_bpe_tokenizer  # noqa: E402
from nemo_ckpt.logger import NeMoLogger  # noqa: E402
from nemo_ckpt.models import GPTModel  # noqa: E402
from nemo_ckpt.models.gpt.convert.checkpoint_io import checkpoint_gpt_config  # noqa: E402
from nemo_ckpt.strategy import MegatronStrategy  # noqa: E402
from tests.helpers.trainer import build_trainer  # noqa: E402

TEXT = "echo the words back: alpha beta gamma delta"


@pytest.fixture(scope="module")
def imported_with_tokenizer(tmp_path_factory):
    """A tiny HF Llama whose directory holds its own BPE tokenizer, imported; and an SFT set."""
    root = tmp_path_factory.mktemp("artifacts")
    (root / "corpus.txt").write_text("\n".join([TEXT] * 20))
    tokenizer = train_bpe_tokenizer([root / "corpus.txt"], 64, root / "hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    base = import_ckpt(f"hf://{root / 'hf'}", str(root / "base"))
    (root / "sft").mkdir()
    (root / "sft" / "training.jsonl").write_text(json.dumps({"input": "echo alpha", "output": "alpha"}) + "\n")
    return base, root / "sft", tokenizer


def test_finetune_tokenizes_with_the_restored_checkpoints_tokenizer(tmp_path, imported_with_tokenizer):
    base, sft, original = imported_with_tokenizer
    data = FineTuningDataModule(str(sft), tokenizer=None, seq_length=16, micro_batch_size=1, global_batch_size=1)
    trainer = build_trainer(MegatronStrategy(), max_steps=1)
    finetune(
        GPTModel(checkpoint_gpt_config(base)),
        data,
        trainer,
        NeMoLogger(log_dir=str(tmp_path), ckpt=None),
        AutoResume(restore_config=RestoreConfig(path=str(base))),
    )
    assert data.tokenizer_path == str(hf_artifacts_dir(base))
    assert data.tokenizer.text_to_ids(TEXT) == original.text_to_ids(TEXT)
    assert data.train_set[0]["tokens"][:2].tolist() == original.text_to_ids("echo alpha")[:2]


def test_load_artifacts_replaces_or_keeps_the_data_modules_tokenizer(imported_with_tokenizer, caplog):
    base, sft, original = imported_with_tokenizer
    data = FineTuningDataModule(str(sft), tokenizer="byte-level")
    restore_artifacts(RestoreConfig(path=str(base), load_artifacts=False), data)
    assert data.tokenizer_path == "byte-level"
    with caplog.at_level(logging.WARNING):
        restore_artifacts(RestoreConfig(path=str(base)), data)
    assert data.tokenizer_path == str(hf_artifacts_dir(base))
    assert "not byte-level" in caplog.text
    assert get_tokenizer(data.tokenizer_path).vocab_size == original.vocab_size != 256


def test_no_tokenizer_anywhere_is_a_clear_error(tmp_path, imported_with_tokenizer):
    _, sft, _ = imported_with_tokenizer
    bare = tmp_path / "bare"
    hf_artifacts_dir(bare).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"holds no tokenizer .* FineTuningDataModule\(tokenizer=None\)"):
        restore_artifacts(RestoreConfig(path=str(bare)), FineTuningDataModule(str(sft)))
    restore_artifacts(RestoreConfig(path=str(bare)), kept := FineTuningDataModule(str(sft), tokenizer="byte-level"))
    assert kept.tokenizer_path == "byte-level"

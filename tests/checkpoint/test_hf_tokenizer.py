"""A checkpoint's tokenizer as Hugging Face files (`context/hf`): `AutoTokenizer` loads each kind of training
tokenizer (byte-level, Hugging Face, SentencePiece) with the ids training used, eos the end-of-document token."""

import json
from pathlib import Path

import pytest

from nemo_ckpt.checkpoint.hf_tokenizer import (
    save_tokenizer,
    special_token_ids,
    stored_tokenizer_files,
    tokenizer_files,
    vocabulary_size,
)
from nemo_ckpt.data.tokenizer import (
    ByteLevelTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    train_bpe_tokenizer,
    train_gpt2_bpe_tokenizer,
)
from tests.helpers.tokenizers import TEXT, train_sentencepiece

transformers = pytest.importorskip("transformers")


def _config(directory: Path) -> dict:
    return json.loads((directory / "tokenizer_config.json").read_text())


def test_byte_level_tokenizer_json_gives_the_byte_ids(tmp_path):
    from tokenizers import Tokenizer as FastTokenizer

    training = ByteLevelTokenizer()
    files = tokenizer_files(training)
    assert save_tokenizer(training, tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    every_byte = bytes(range(256)).decode("latin-1")  # code points 0-255: each a 1- or 2-byte UTF-8 sequence
    backend = FastTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    backend.encode_special_tokens = True  # what tokenizer_config.json's split_special_tokens makes transformers do
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in (TEXT, every_byte, ""):
        expected = training.text_to_ids(text)
        assert backend.encode(text, add_special_tokens=False).ids == expected
        assert loaded(text)["input_ids"] == expected  # a literal "<eod>" in TEXT stays bytes, as in training
        assert loaded.decode(expected + [training.eod], skip_special_tokens=True) == text
    assert backend.get_vocab_size(with_added_tokens=True) == training.vocab_size == vocabulary_size(files) == 257
    assert loaded.eos_token_id == loaded.pad_token_id == loaded.bos_token_id == training.eod == 256
    assert special_token_ids(files) == {"bos_token_id": 256, "eos_token_id": 256, "pad_token_id": 256}
    assert HFTokenizer(tmp_path).text_to_ids(TEXT) == training.text_to_ids(TEXT)  # what a restore tokenizes with
    assert HFTokenizer(tmp_path).eod == 256


def test_hf_tokenizer_names_its_end_of_document_token_eos_and_pad(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT * 20)
    trained = train_bpe_tokenizer([tmp_path / "corpus.txt"], 120, tmp_path / "bpe")  # tokenizer.json only
    save_tokenizer(trained, tmp_path / "stored")
    assert _config(tmp_path / "stored") == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eod>",
        "pad_token": "<eod>",
    }
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "stored")
    assert loaded(TEXT.replace("<eod>", ""))["input_ids"] == trained.text_to_ids(TEXT.replace("<eod>", ""))
    assert loaded.eos_token_id == loaded.pad_token_id == trained.eod == 0

    # a saved tokenizer: its own pad stays; training's end-of-document token (eod_token=) becomes the eos
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "bpe" / "tokenizer.json"), eos_token="<eod>", pad_token="<unk>"
    ).save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eod>"}))
    files = tokenizer_files(HFTokenizer(tmp_path / "saved", eod_token="<unk>"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        assert json.loads(files[name])["eos_token"] == "<unk>"
    assert json.loads(files["tokenizer_config.json"])["pad_token"] == "<unk>"
    assert special_token_ids(files) == {"bos_token_id": None, "eos_token_id": 1, "pad_token_id": 1}


def test_sentencepiece_model_loads_with_its_ids(tmp_path):
    training = SentencePieceTokenizer(train_sentencepiece(tmp_path / "spm"))
    save_tokenizer(training, tmp_path / "stored")
    assert sorted(p.name for p in (tmp_path / "stored").iterdir()) == ["tokenizer.model", "tokenizer_config.json"]
    assert (tmp_path / "stored" / "tokenizer.model").read_bytes() == training.path.read_bytes()
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "stored")
    for text in (TEXT, "  leading and trailing  ", "a\nb"):
        assert loaded(text)["input_ids"] == training.text_to_ids(text)  # no bos added; "</s>" in text stays text
    assert (
        (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, training.eod, training.eod) == (1, 2, 2)
    )
    assert len(loaded) == training.vocab_size == vocabulary_size(stored_tokenizer_files(tmp_path / "stored"))


def test_stored_tokenizer_is_completed_as_training_reads_it(tmp_path, caplog):
    (tmp_path / "corpus.txt").write_text(TEXT * 20)
    train_bpe_tokenizer([tmp_path / "corpus.txt"], 120, tmp_path / "hf")
    files = stored_tokenizer_files(tmp_path / "hf")  # an imported model's raw files: no tokenizer_config.json
    assert json.loads(files["tokenizer_config.json"])["eos_token"] == "<eod>"
    assert special_token_ids(files)["pad_token_id"] == 0

    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models

    (tmp_path / "unknown").mkdir()  # a tokenizer with no end-of-document token among those training knows
    FastTokenizer(models.WordLevel({"a": 0, "<sep>": 1}, unk_token="<sep>")).save(
        str(tmp_path / "unknown" / "tokenizer.json")
    )
    assert stored_tokenizer_files(tmp_path / "unknown").keys() == {"tokenizer.json"}  # as it is, with a warning
    assert "no end-of-document token" in caplog.text


def test_gpt2_bpe_tokenizer_is_stored_as_tokenizer_json_with_its_ids(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT * 20)
    training = train_gpt2_bpe_tokenizer([tmp_path / "corpus.txt"], 300, tmp_path / "gpt2")
    assert save_tokenizer(training, tmp_path / "stored") == ["tokenizer.json", "tokenizer_config.json"]
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "stored")
    assert loaded(TEXT, add_special_tokens=False)["input_ids"] == training.text_to_ids(TEXT)
    assert loaded.eos_token_id == loaded.bos_token_id == loaded.pad_token_id == training.eod

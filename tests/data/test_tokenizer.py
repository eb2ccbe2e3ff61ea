"""Tokenizers from local files only: byte-level, a BPE trained here, SentencePiece, and the factories."""

import json

import pytest

from nemo_ckpt.data.tokenizer import (
    ByteLevelTokenizer,
    HFTokenizer,
    get_nmt_tokenizer,
    get_tokenizer,
    train_bpe_tokenizer,
)

TEXT = "the cat sat on the mat. the dog sat on the log. a cat and a dog met on the mat.\n" * 20


def test_byte_level_round_trip():
    tokenizer = get_tokenizer("byte-level")
    ids = tokenizer.text_to_ids("héllo")
    assert ids == list("héllo".encode())
    assert tokenizer.ids_to_text(ids + [tokenizer.eod]) == "héllo"
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    assert isinstance(get_nmt_tokenizer("byte-level"), ByteLevelTokenizer)


def test_trained_bpe_tokenizer_round_trips_and_reloads(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": line}) + "\n" for line in TEXT.splitlines()))
    trained = train_bpe_tokenizer([corpus], vocab_size=60, output_dir=tmp_path / "tok", json_key="text")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert trained.vocab_size <= 60
    ids = trained.text_to_ids("the cat sat on the mat.")
    assert len(ids) < len("the cat sat on the mat.")  # merges were learnt
    assert trained.ids_to_text(ids) == "the cat sat on the mat."
    reloaded = get_nmt_tokenizer("huggingface", model_name=str(tmp_path / "tok"))
    assert isinstance(reloaded, HFTokenizer)
    assert reloaded.text_to_ids("a dog met") == trained.text_to_ids("a dog met")
    assert reloaded.eod == trained.eod == 0  # <eod> is the first special token


def test_missing_tokenizer_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist: pass a local directory"):
        get_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        get_tokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match="Unknown tokenizer library 'tiktoken'"):
        get_nmt_tokenizer("tiktoken")


def test_sentencepiece_model(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    (tmp_path / "text.txt").write_text(TEXT)
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=20, eos_id=2, minloglevel=2
    )
    tokenizer = get_tokenizer(tmp_path / "sp.model")
    assert tokenizer.eod == 2 and tokenizer.vocab_size == 20
    assert tokenizer.ids_to_text(tokenizer.text_to_ids("the cat sat")) == "the cat sat"


def test_auto_tokenizer_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "c.txt").write_text(TEXT)
    trained = train_bpe_tokenizer([tmp_path / "c.txt"], vocab_size=60, output_dir=tmp_path / "raw")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "raw" / "tokenizer.json"), eos_token="<eod>"
    )
    fast.save_pretrained(tmp_path / "hf")
    tokenizer = get_tokenizer(tmp_path / "hf")
    assert tokenizer.eod == fast.eos_token_id
    assert tokenizer.text_to_ids("the cat") == trained.text_to_ids("the cat")

"""Tokenizers from local files only: byte-level, BPEs trained here (ours, GPT-2's), SentencePiece, the factories."""

import ast
import importlib
import json
import re
import shutil
from pathlib import Path

import pytest

import nemo_ckpt.data.tokenizer as tokenizer_module
from nemo_ckpt.data.tokenizer import (
    SENTENCEPIECE_TOKENIZER_TYPES,
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    HFTokenizer,
    build_tokenizer,
    get_nmt_tokenizer,
    get_tokenizer,
    tokenizer_type_error,
    train_bpe_tokenizer,
    train_gpt2_bpe_tokenizer,
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


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    (directory / "text.txt").write_text(TEXT)
    train_gpt2_bpe_tokenizer([directory / "text.txt"], vocab_size=300, output_dir=directory)
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def test_gpt2_bpe_tokenizer_from_vocab_and_merges(gpt2_files):
    vocab_file, merge_file = gpt2_files
    vocab = json.loads(Path(vocab_file).read_text())
    assert Path(merge_file).read_text().startswith("#version")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert isinstance(tokenizer, GPT2BPETokenizer)
    assert tokenizer.eod == vocab["<|endoftext|>"] and 257 < tokenizer.vocab_size == len(vocab) <= 300
    text = "the cat sat on the mat. héllo\n  a dog"
    ids = tokenizer.text_to_ids(text)
    assert len(ids) < len(text.encode()) and tokenizer.ids_to_text(ids) == text  # byte-level: every text round-trips
    assert tokenizer.text_to_ids("a cat<|endoftext|>") == tokenizer.text_to_ids("a cat") + [tokenizer.eod]


def test_gpt2_bpe_tokenizer_matches_transformers_gpt2(gpt2_files, tmp_path):
    """The GPT-2 tokenizer of transformers from the same files: what megatron-core's GPT2BPETokenizer loads."""
    transformers = pytest.importorskip("transformers")
    vocab_file, merge_file = gpt2_files
    shutil.copy(vocab_file, tmp_path / "vocab.json")
    shutil.copy(merge_file, tmp_path / "merges.txt")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    ours = GPT2BPETokenizer(vocab_file, merge_file)
    for text in [
        "the cat sat on the mat.",
        " leading space,  two  spaces\n\nand 123 numbers!",
        "ünïcødé 🐈",
        "x<|endoftext|>y",
    ]:
        assert ours.text_to_ids(text) == theirs(text).input_ids
    assert ours.eod == theirs.eos_token_id and ours.vocab_size == len(theirs)


def test_gpt2_bpe_tokenizer_errors(gpt2_files, tmp_path):
    vocab_file, merge_file = gpt2_files
    with pytest.raises(FileNotFoundError, match="--vocab-file '.*nope.json' does not exist"):
        GPT2BPETokenizer(tmp_path / "nope.json", merge_file)
    with pytest.raises(FileNotFoundError, match="--merge-file '.*nope.txt' does not exist"):
        GPT2BPETokenizer(vocab_file, tmp_path / "nope.txt")
    (tmp_path / "bad.json").write_text("not json")
    with pytest.raises(ValueError, match="are not a GPT-2 vocab.json / merges.txt"):
        GPT2BPETokenizer(tmp_path / "bad.json", merge_file)
    vocab = json.loads(Path(vocab_file).read_text())
    vocab = {token: i for i, token in enumerate(token for token in vocab if token != "<|endoftext|>")}
    (tmp_path / "no_eod.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="no_eod.json has no <\\|endoftext\\|>"):
        GPT2BPETokenizer(tmp_path / "no_eod.json", merge_file)


def test_build_tokenizer_types(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    (tmp_path / "text.txt").write_text(TEXT)
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=20, eos_id=2, minloglevel=2
    )
    assert isinstance(build_tokenizer("byte-level"), ByteLevelTokenizer)
    for name in SENTENCEPIECE_TOKENIZER_TYPES:  # megatron-core builds the same SentencePiece tokenizer for each
        tokenizer = build_tokenizer(name, tokenizer_model=str(tmp_path / "sp.model"))
        assert tokenizer.eod == 2 and tokenizer.text_to_ids("the cat") == get_tokenizer(
            tmp_path / "sp.model"
        ).text_to_ids("the cat")
    train_bpe_tokenizer([tmp_path / "text.txt"], vocab_size=60, output_dir=tmp_path / "hf")
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    assert isinstance(hf, HFTokenizer) and hf.text_to_ids("the cat") == get_tokenizer(tmp_path / "hf").text_to_ids(
        "the cat"
    )


def test_hugging_face_tokenizer_type_adds_special_tokens(tmp_path):
    """Megatron-LM's HuggingFaceTokenizer encodes with the post-processor (`tokenizer(text).input_ids`); the
    `get_tokenizer` shorthand does not."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import processors

    (tmp_path / "text.txt").write_text(TEXT)
    train_bpe_tokenizer([tmp_path / "text.txt"], vocab_size=60, output_dir=tmp_path / "tok")
    tokenizer = FastTokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    tokenizer.add_special_tokens(["<bos>"])
    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    plain = get_tokenizer(tmp_path / "tok").text_to_ids("the cat")
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok")).text_to_ids("the cat") == [bos, *plain]
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tok")).text_to_ids("") == [bos]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("tiktoken",), "--tokenizer-type 'tiktoken' is not supported; choose one of HuggingFaceTokenizer, "),
        (("GPT2BPETokenizer",), "GPT2BPETokenizer needs --vocab-file \\(a GPT-2 vocab.json\\) and --merge-file"),
        (("GPT2BPETokenizer", None, "v.json"), "GPT2BPETokenizer needs --merge-file \\(a GPT-2 merges.txt\\)$"),
        (("GPT2BPETokenizer", "m", "v", "m"), "GPT2BPETokenizer does not use --tokenizer-model; remove it"),
        (("HuggingFaceTokenizer",), "HuggingFaceTokenizer needs --tokenizer-model \\(a local Hugging Face"),
        (("HuggingFaceTokenizer", "dir", "v.json"), "HuggingFaceTokenizer does not use --vocab-file; remove it"),
        (("Llama2Tokenizer",), "Llama2Tokenizer needs --tokenizer-model \\(a SentencePiece .model file\\)"),
        (("byte-level", "x", None, "m"), "byte-level does not use --tokenizer-model or --merge-file; remove it"),
    ],
)
def test_build_tokenizer_errors_name_the_option(arguments, message):
    assert re.search(message, tokenizer_type_error(*arguments))
    with pytest.raises(ValueError, match=message):
        build_tokenizer(*arguments)


def _dotted_names_in_error_messages(source: str) -> set[str]:
    """Every `nemo_ckpt.x.y` named in the string constants (f-strings included) of the raise statements of `source`."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise):
            for constant in ast.walk(node):
                if isinstance(constant, ast.Constant) and isinstance(constant.value, str):
                    names.update(re.findall(r"\bnemo_ckpt(?:\.\w+)+", constant.value))
    return names


def test_error_messages_name_importable_nemo_ckpt_paths():
    names = _dotted_names_in_error_messages(Path(tokenizer_module.__file__).read_text())
    assert "nemo_ckpt.data.tokenizer.train_bpe_tokenizer" in names
    for name in names:
        parts = name.split(".")
        # the longest importable module, then attributes (a function or class named after its module)
        for cut in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attribute in parts[cut:]:
            assert hasattr(target, attribute), f"{name}: {'.'.join(parts[:cut])} has no {attribute}"
            target = getattr(target, attribute)

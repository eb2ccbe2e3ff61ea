"""`python -m nemo_ckpt.data.preprocess`: JSONL -> one indexed dataset, in parallel, nothing left by a failure, with
Megatron-LM's options (tokenizer types, sentences, partitions) and its documents (empty ones included)."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from nemo_ckpt.data.indexed_dataset import IndexedDataset
from nemo_ckpt.data.preprocess import main, split_sentences
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer, build_tokenizer, train_bpe_tokenizer, train_gpt2_bpe_tokenizer

DOCUMENTS = [f"document {i}: " + "word " * (i % 7) for i in range(1500)]


def write_jsonl(path, texts, key="text"):
    path.write_text("".join(json.dumps({key: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    first = write_jsonl(directory / "a.jsonl", DOCUMENTS[:1000])
    second = write_jsonl(directory / "b.jsonl", DOCUMENTS[1000:])
    return first, second


def test_several_inputs_make_one_dataset_with_eod(inputs, tmp_path):
    code = main(
        ["--input", *inputs, "--tokenizer", "byte-level", "--output-prefix", str(tmp_path / "out"), "--append-eod"]
    )
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out_text_document.bin", "out_text_document.idx"]
    dataset = IndexedDataset(tmp_path / "out_text_document")
    tokenizer = ByteLevelTokenizer()
    assert dataset.dtype == np.uint16 and len(dataset) == len(DOCUMENTS)
    assert dataset.document_indices.tolist() == list(range(len(DOCUMENTS) + 1))
    for index in (0, 999, 1000, 1499):
        assert dataset[index].tolist() == tokenizer.text_to_ids(DOCUMENTS[index]) + [tokenizer.eod]


def test_workers_write_the_same_bytes_as_one_process(inputs, tmp_path):
    command = [sys.executable, "-m", "nemo_ckpt.data.preprocess", "--input", *inputs, "--tokenizer", "byte-level"]
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}")
        result = subprocess.run([*command, "--output-prefix", prefix, "--workers", str(workers)], capture_output=True)
        assert result.returncode == 0, result.stderr.decode()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{suffix}").read_bytes() == (
            tmp_path / f"w2_text_document{suffix}"
        ).read_bytes()


@pytest.mark.parametrize(
    "lines, message",
    [
        (["", "   "], r"no token of --json-keys text in its 0 documents; nothing to write"),
        (['{"text": ""}', '{"text": []}'], r"no token of --json-keys text in its 2 documents; nothing to write"),
        (['{"text": 3}'], r"bad\.jsonl:1: 'text' is neither a string nor a list of strings"),
        (['{"text": ["a", 1]}'], r"bad\.jsonl:1: 'text' is neither a string nor a list of strings"),
        (['["text"]'], r"bad\.jsonl:1 is a JSON list, not an object"),
        (['{"text": "ok"}', "not json"], r"bad\.jsonl:2 is not valid JSON"),
        (['{"body": "x"}'], r"bad\.jsonl:1 has no key 'text' \(keys: \['body'\]\); fix --json-keys"),
    ],
)
def test_bad_corpus_fails_and_leaves_nothing(tmp_path, capsys, lines, message):
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    args = ["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", "byte-level", "--output-prefix", str(out / "x")]
    assert main(args) == 2
    assert re.search(message, capsys.readouterr().err)
    assert list(out.iterdir()) == []


def test_missing_input_and_tokenizer_are_named(tmp_path, capsys):
    (tmp_path / "ok.jsonl").write_text('{"text": "x"}\n')
    assert main(["--input", str(tmp_path / "nope.jsonl"), "--tokenizer", "byte-level", "--output-prefix", "o"]) == 2
    assert "nope.jsonl not found" in capsys.readouterr().err
    args = ["--input", str(tmp_path / "ok.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--output-prefix", "o"]
    assert main(args) == 2
    assert "tok' does not exist" in capsys.readouterr().err


def run(tmp_path, records, *options, prefix="out"):
    """Preprocess JSONL `records` (dicts, or raw lines as strings) with byte-level unless `options` say otherwise."""
    lines = [record if isinstance(record, str) else json.dumps(record) for record in records]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    tokenizer = [] if any(o.startswith("--tokenizer") for o in options) else ["--tokenizer", "byte-level"]
    args = ["--input", str(tmp_path / "in.jsonl"), *tokenizer, "--output-prefix", str(tmp_path / prefix), *options]
    assert main(args) == 0
    return tmp_path / prefix


def ids(text):
    return list(text.encode())


@pytest.mark.parametrize("append_eod", [False, True])
def test_empty_documents_are_documents_of_no_sequence(tmp_path, append_eod):
    """Megatron-LM: every JSON line is a document; an empty one has no sequence and no EOD. Blank lines are skipped."""
    options = ["--append-eod"] if append_eod else []
    prefix = run(tmp_path, [{"text": "ab"}, {"text": ""}, "", "   ", {"text": "c"}, {"text": ""}], *options)
    dataset = IndexedDataset(f"{prefix}_text_document")
    eod = [256] if append_eod else []
    assert [d.tolist() for d in dataset[0 : len(dataset)]] == [ids("ab") + eod, ids("c") + eod]
    assert dataset.document_indices.tolist() == [0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    "text, keep_newlines, sentences",
    [
        ("Hello world. How are you? Fine!", False, ["Hello world.", "How are you?", "Fine!"]),
        ('  He said "stop." Then (he left.)\n\nThe end.  ', False, ['He said "stop."', "Then (he left.)", "The end."]),
        ("Pi is 3.14 today... Yes!! ok", False, ["Pi is 3.14 today...", "Yes!!", "ok"]),
        ("Dr. No", False, ["Dr.", "No"]),  # no learnt abbreviations, unlike punkt's English model
        ("No break.Here", False, ["No break.Here"]),
        ("", False, []),
        (" \n ", False, []),
        ("One.\nTwo!  Three", True, ["One.\n", "Two!  ", "Three"]),
        (" Lead. Trail. \n", True, [" Lead. ", "Trail. \n"]),
    ],
)
def test_split_sentences(text, keep_newlines, sentences):
    assert split_sentences(text, keep_newlines) == sentences
    if keep_newlines:
        assert "".join(sentences) == text


def test_split_sentences_writes_a_sequence_per_sentence(tmp_path, capsys):
    records = [
        {"text": "One two. Three!", "title": "A title."},
        {"text": "", "title": "Empty text."},
        {"text": "Last one", "title": ""},
    ]
    prefix = run(tmp_path, records, "--split-sentences", "--append-eod", "--json-keys", "text", "title")
    assert sorted(p.name for p in tmp_path.glob("out_*")) == [
        "out_text_sentence.bin",
        "out_text_sentence.idx",
        "out_title_sentence.bin",
        "out_title_sentence.idx",
    ]
    assert f"wrote {prefix}_text_sentence.bin and {prefix}_text_sentence.idx" in capsys.readouterr().out
    text = IndexedDataset(f"{prefix}_text_sentence")
    assert [d.tolist() for d in text[0 : len(text)]] == [
        ids("One two."),
        ids("Three!") + [256],
        ids("Last one") + [256],
    ]
    assert text.document_indices.tolist() == [0, 2, 2, 3]
    title = IndexedDataset(f"{prefix}_title_sentence")
    assert title.sequence_lengths.tolist() == [9, 12] and title.document_indices.tolist() == [0, 1, 2, 2]


def test_keep_newlines(tmp_path):
    prefix = run(tmp_path, [{"text": "One.\nTwo."}], "--split-sentences", "--keep-newlines")
    dataset = IndexedDataset(f"{prefix}_text_sentence")
    assert [d.tolist() for d in dataset[0 : len(dataset)]] == [ids("One.\n"), ids("Two.")]


def test_lists_of_strings_are_documents_of_those_sequences(tmp_path):
    """Megatron-LM's sentence-split files: a list value is the document's sequences (empty ones dropped)."""
    prefix = run(tmp_path, [{"text": ["ab", "", "c"]}, {"text": "de"}], "--append-eod")
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert [d.tolist() for d in dataset[0 : len(dataset)]] == [ids("ab"), ids("c") + [256], ids("de") + [256]]
    assert dataset.document_indices.tolist() == [0, 2, 3]


def test_partitions_order_documents_as_megatron(tmp_path):
    """Megatron-LM deals lines round-robin into the partitions and writes them one after the other; with
    --keep-sequential-samples the partitions are consecutive blocks, so the input order stays."""
    records = [{"text": f"doc {i}"} for i in range(7)]
    dataset = IndexedDataset(f"{run(tmp_path, records, '--partitions', '3', prefix='p3')}_text_document")
    assert [bytes(d.astype(np.uint8)).decode() for d in dataset[0 : len(dataset)]] == [
        f"doc {i}" for i in (0, 3, 6, 1, 4, 2, 5)
    ]
    assert dataset.document_indices.tolist() == list(range(8))
    run(tmp_path, records, "--partitions", "3", "--keep-sequential-samples", prefix="seq")
    run(tmp_path, records, prefix="plain")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"seq_text_document{suffix}").read_bytes() == (
            tmp_path / f"plain_text_document{suffix}"
        ).read_bytes()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # the partitions' files are gone


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A GPT-2 BPE, a Hugging Face BPE and a SentencePiece model trained here on DOCUMENTS."""
    sentencepiece = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("tokenizers")
    corpus = write_jsonl(directory / "corpus.jsonl", DOCUMENTS[:200])
    train_gpt2_bpe_tokenizer([corpus], 300, directory / "gpt2", json_key="text")
    train_bpe_tokenizer([corpus], 60, directory / "hf", json_key="text")
    (directory / "text.txt").write_text("\n".join(DOCUMENTS[:200]))
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "text.txt"), model_prefix=str(directory / "sp"), vocab_size=30, eos_id=2, minloglevel=2
    )
    return directory


@pytest.mark.parametrize(
    "tokenizer_type, files",
    [
        ("byte-level", {}),
        ("GPT2BPETokenizer", {"vocab_file": "gpt2/vocab.json", "merge_file": "gpt2/merges.txt"}),
        ("HuggingFaceTokenizer", {"tokenizer_model": "hf"}),
        ("SentencePieceTokenizer", {"tokenizer_model": "sp.model"}),
        ("GPTSentencePieceTokenizer", {"tokenizer_model": "sp.model"}),
    ],
)
def test_tokenizer_types(tokenizer_files, tmp_path, tokenizer_type, files):
    paths = {name: str(tokenizer_files / file) for name, file in files.items()}
    options = ["--tokenizer-type", tokenizer_type]
    options += [item for name, path in paths.items() for item in (f"--{name.replace('_', '-')}", path)]
    texts = ["document 1: word word", "", "document 2: héllo"]
    prefix = run(tmp_path, [{"text": text} for text in texts], *options, "--append-eod")
    tokenizer = build_tokenizer(tokenizer_type, **paths)
    dataset = IndexedDataset(f"{prefix}_text_document")
    assert dataset.dtype == np.uint16
    expected = [tokenizer.text_to_ids(text) + [tokenizer.eod] for text in texts if text]
    assert [d.tolist() for d in dataset[0 : len(dataset)]] == expected
    assert dataset.document_indices.tolist() == [0, 1, 1, 2]


def test_summary_names_documents_tokens_and_throughput(tmp_path, capsys):
    run(tmp_path, [{"text": "abc"}, {"text": ""}, {"text": "de"}], "--append-eod")
    summary = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"Processed 3 documents, 7 tokens in \S+ s \(\S+ documents/s, \S+ MB/s\)", summary), summary


@pytest.mark.parametrize(
    "options, message",
    [
        (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
        (
            ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"],
            "--tokenizer-type GPT2BPETokenizer needs --merge-file",
        ),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
        (["--tokenizer-type", "SentencePieceTokenizer"], "SentencePieceTokenizer needs --tokenizer-model"),
        (["--tokenizer-type", "byte-level", "--vocab-file", "v"], "byte-level does not use --vocab-file; remove it"),
        (["--tokenizer-type", "tiktoken"], "argument --tokenizer-type: invalid choice: 'tiktoken'"),
        ([], "give --tokenizer-type \\(HuggingFaceTokenizer, GPT2BPETokenizer, .*\\) or the --tokenizer shorthand"),
        (["--tokenizer", "byte-level", "--tokenizer-type", "byte-level"], "are alternatives; give one"),
        (
            ["--tokenizer", "byte-level", "--merge-file", "m"],
            "--tokenizer takes no --merge-file; give --tokenizer-type",
        ),
        (["--tokenizer", "byte-level", "--keep-newlines"], "--keep-newlines applies to --split-sentences"),
        (
            ["--tokenizer", "byte-level", "--keep-sequential-samples"],
            "--keep-sequential-samples applies to --partitions above 1",
        ),
        (["--tokenizer", "byte-level", "--partitions", "0"], "--partitions must be at least 1"),
        (["--tokenizer", "byte-level", "--workers", "0"], "--workers must be at least 1"),
    ],
)
def test_inconsistent_options_are_usage_errors(tmp_path, capsys, options, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["--input", "in.jsonl", "--output-prefix", str(tmp_path / "out"), *options])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_missing_tokenizer_files_are_named(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    options = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "v.json"), "--merge-file", "m"]
    assert main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"), *options]) == 2
    assert re.search(r"GPT2BPETokenizer: --vocab-file '.*v\.json' does not exist", capsys.readouterr().err)

"""`python -m nemo_ckpt.data.preprocess`: JSONL -> one indexed dataset, in parallel, nothing left by a failure."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from nemo_ckpt.data.indexed_dataset import IndexedDataset
from nemo_ckpt.data.preprocess import main
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer

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
        (["", "   "], "no non-empty document"),
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

"""`python -m nemo_ckpt.data.preprocess` writes the bytes of Megatron-LM's `tools/preprocess_data.py`.

The expected files come from megatron-core's own `IndexedDatasetBuilder`, fed by Megatron-LM's `Encoder` and writer
loop copied below (they are in Megatron-LM, not in the megatron-core wheel), with megatron-core's tokenizers where
they build offline (`build_tokenizer`: HuggingFaceTokenizer, the SentencePiece types; GPT2BPETokenizer is its
Hugging Face GPT-2 tokenizer, loaded here from the same vocab.json/merges.txt through megatron-core's
HuggingFaceTokenizer, since megatron-core's GPT2BPETokenizer fetches gpt2's configuration from the Hub). Punkt needs
a download, so the reference splits sentences with ours: what is compared is how documents, sentences, empty
documents, EOD and partitions are written. Runs against megatron-core 0.19.2 as `tests/install_megatron_core.sh`
installs it; skipped without it.
"""

import argparse
import json
import math
import shutil

import pytest

from tests.helpers.megatron import importorskip_megatron_core

megatron_indexed = importorskip_megatron_core("megatron.core.datasets.indexed_dataset")

from nemo_ckpt.data.preprocess import main, split_sentences  # noqa: E402
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer, train_bpe_tokenizer, train_gpt2_bpe_tokenizer  # noqa: E402

# an empty document in the middle, one that is only whitespace, several sentences, and GPT-2's EOD as text
DOCUMENTS = [
    "The cat sat on the mat. Then it slept!  A dog came by?\nIt barked.",
    "One sentence only",
    "",
    "   ",
    'He said "stop." She left. héllo wörld, 3.14 is pi... End',
    "Text with <|endoftext|> inside. And after.",
    "Last document. Two sentences.",
]


class IdentitySplitter:
    def tokenize(self, *text):
        return text


class RegexSplitter:
    """Stands in for NLTK punkt (a download)."""

    def tokenize(self, text):
        return split_sentences(text)


class Encoder:
    """Megatron-LM's `tools/preprocess_data.py` Encoder: `split` (the sentence-split file) and `encode`."""

    def __init__(self, tokenizer, json_keys, append_eod, split_sentences):
        self.tokenizer, self.json_keys, self.append_eod = tokenizer, json_keys, append_eod
        self.splitter = RegexSplitter() if split_sentences else IdentitySplitter()

    def split(self, json_line):
        data = json.loads(json_line)
        output = {}
        for key in self.json_keys:
            text = data[key]
            max_len = 1000000
            tokens_list = [self.splitter.tokenize(text[i : i + max_len]) for i in range(0, len(text), max_len)]
            output[key] = [tokens for partial in tokens_list for tokens in partial]
        return json.dumps(output), len(json_line)

    def encode(self, json_line):
        data = json.loads(json_line)
        ids = {}
        lens = {}
        for key in self.json_keys:
            text = data[key]
            if isinstance(text, list):
                sentences = text
            else:
                sentences = [text]
            doc_ids = []
            sentence_lens = []
            for sentence in sentences:
                sentence_ids = self.tokenizer.tokenize(sentence)
                if len(sentence_ids) > 0:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if len(doc_ids) > 0 and self.append_eod:
                doc_ids.append(self.tokenizer.eod)
                sentence_lens[-1] += 1
            ids[key] = doc_ids
            lens[key] = sentence_lens
        return ids, lens, len(json_line)


def megatron_preprocess(lines, tokenizer, output_prefix, json_keys, append_eod, split, partitions, sequential):
    """Megatron-LM's main(): lines dealt into partitions (round-robin, or blocks with --keep-sequential-samples),
    each split into sentences and encoded into `<prefix>_<i>_<key>_<level>`, then merged with `add_index`."""
    encoder = Encoder(tokenizer, json_keys, append_eod, split)
    level = "sentence" if split else "document"
    dtype = megatron_indexed.DType.optimal_dtype(tokenizer.vocab_size)
    if partitions == 1:
        shards = [(lines, output_prefix)]
    else:
        shards = [([], f"{output_prefix}_{index}") for index in range(partitions)]
        partition_size = math.ceil(len(lines) / partitions)
        index = 0
        for line_count, line in enumerate(lines, start=1):
            shards[index][0].append(line)
            if sequential:
                if line_count % partition_size == 0:
                    index += 1
            else:
                index = (index + 1) % partitions
    for shard_lines, shard_prefix in shards:
        if split:
            shard_lines = [encoder.split(line)[0] for line in shard_lines]
        builders = {
            key: megatron_indexed.IndexedDatasetBuilder(f"{shard_prefix}_{key}_{level}.bin", dtype=dtype)
            for key in json_keys
        }
        for doc, sentence_lens, _ in map(encoder.encode, shard_lines):
            for key in doc.keys():
                builders[key].add_document(doc[key], sentence_lens[key])
        for key in json_keys:
            builders[key].finalize(f"{shard_prefix}_{key}_{level}.idx")
    if partitions > 1:
        for key in json_keys:
            builder = megatron_indexed.IndexedDatasetBuilder(f"{output_prefix}_{key}_{level}.bin", dtype=dtype)
            for _, shard_prefix in shards:
                builder.add_index(f"{shard_prefix}_{key}_{level}")
            builder.finalize(f"{output_prefix}_{key}_{level}.idx")


class MegatronByteLevel:
    """Ours in megatron-core's tokenizer interface (Megatron-LM's preprocess_data.py has no byte-level type)."""

    def __init__(self):
        self._tokenizer = ByteLevelTokenizer()
        self.vocab_size, self.eod = self._tokenizer.vocab_size, self._tokenizer.eod

    def tokenize(self, text):
        return self._tokenizer.text_to_ids(text)


def megatron_tokenizer(tokenizer_type, tokenizer_model):
    """megatron-core's `build_tokenizer` with Megatron-LM's default tokenizer arguments."""
    build = importorskip_megatron_core("megatron.core.tokenizers.utils.build_tokenizer").build_tokenizer
    args = argparse.Namespace(
        tokenizer_type=tokenizer_type,
        tokenizer_model=str(tokenizer_model),
        vocab_file=None,
        merge_file=None,
        special_tokens=None,
        tokenizer_hf_no_use_fast=False,
        tokenizer_hf_no_include_special_tokens=False,
        trust_remote_code=False,
        chat_template=None,
        metadata_path=None,
        pad_vocab_size=False,
        tokenizer_sentencepiece_ignore_extra_whitespaces=True,
        tokenizer_sentencepiece_legacy=False,
    )
    return build(args)


def gpt2_case(corpus, directory):
    """Ours from vocab.json/merges.txt; the reference: transformers' GPT-2 tokenizer of these files (what
    megatron-core's GPT2BPETokenizer builds) in megatron-core's HuggingFaceTokenizer."""
    pytest.importorskip("transformers")
    train_gpt2_bpe_tokenizer([corpus], 320, directory / "gpt2")
    vocab, merges = directory / "gpt2" / "vocab.json", directory / "gpt2" / "merges.txt"
    (directory / "gpt2-hf").mkdir()
    shutil.copy(vocab, directory / "gpt2-hf" / "vocab.json")
    shutil.copy(merges, directory / "gpt2-hf" / "merges.txt")
    (directory / "gpt2-hf" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    options = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)]
    return options, megatron_tokenizer("HuggingFaceTokenizer", directory / "gpt2-hf")


def hugging_face_case(corpus, directory):
    """A BPE whose post-processor adds a BOS token, which Megatron-LM's HuggingFaceTokenizer keeps."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import processors

    train_bpe_tokenizer([corpus], 80, directory / "raw")
    tokenizer = FastTokenizer.from_file(str(directory / "raw" / "tokenizer.json"))
    tokenizer.add_special_tokens(["<bos>"])
    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eod>")
    fast.save_pretrained(directory / "hf")
    options = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory / "hf")]
    return options, megatron_tokenizer("HuggingFaceTokenizer", directory / "hf")


def sentencepiece_case(corpus, directory):
    sentencepiece = pytest.importorskip("sentencepiece")
    prefix = directory / "sp"
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), vocab_size=60, eos_id=2, minloglevel=2
    )
    options = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", f"{prefix}.model"]
    return options, megatron_tokenizer("SentencePieceTokenizer", f"{prefix}.model")


CASES = {
    "byte-level": lambda corpus, directory: (["--tokenizer-type", "byte-level"], MegatronByteLevel()),
    "GPT2BPETokenizer": gpt2_case,
    "HuggingFaceTokenizer": hugging_face_case,
    "SentencePieceTokenizer": sentencepiece_case,
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (our command line options, the reference tokenizer), each made once, on first use."""
    directory = tmp_path_factory.mktemp("tokenizers")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(DOCUMENTS * 20))
    made = {}

    def case(name):
        if name not in made:
            made[name] = CASES[name](corpus, directory)
        return made[name]

    return case


def assert_same_files(tmp_path, lines, options, reference, split, append_eod, partitions=1, sequential=False):
    (tmp_path / "corpus.jsonl").write_text("".join(lines))
    megatron_preprocess(
        lines, reference, str(tmp_path / "megatron"), ["text"], append_eod, split, partitions, sequential
    )
    flags = ["--split-sentences"] * split + ["--append-eod"] * append_eod + ["--partitions", str(partitions)]
    flags += ["--keep-sequential-samples"] * sequential
    prefix = str(tmp_path / "ours")
    assert main(["--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", prefix, *options, *flags]) == 0
    level = "sentence" if split else "document"
    for suffix in (".bin", ".idx"):
        theirs = (tmp_path / f"megatron_text_{level}{suffix}").read_bytes()
        assert (tmp_path / f"ours_text_{level}{suffix}").read_bytes() == theirs, (suffix, options, flags)
    dataset = megatron_indexed.IndexedDataset(prefix + f"_text_{level}")
    empty = [
        i for i, (start, end) in enumerate(zip(dataset.document_indices, dataset.document_indices[1:])) if start == end
    ]
    return dataset, empty


@pytest.mark.parametrize("split", [False, True], ids=["documents", "sentences"])
@pytest.mark.parametrize("append_eod", [False, True], ids=["no-eod", "eod"])
@pytest.mark.parametrize("name", ["byte-level", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"])
def test_same_bytes_as_megatron_lm(tmp_path, tokenizers, name, split, append_eod):
    options, reference = tokenizers(name)
    records = [{"text": text} for text in DOCUMENTS]
    if not split:  # a list is a document of those sequences (Megatron-LM's sentence-split files)
        records.append({"text": ["Pre-split one.", "", "Two"]})
    lines = [json.dumps(record) + "\n" for record in records]
    dataset, empty = assert_same_files(tmp_path, lines, options, reference, split, append_eod)
    assert dataset.document_indices.shape == (len(records) + 1,)
    if name != "HuggingFaceTokenizer":  # its BOS makes every document non-empty, as in Megatron-LM
        # "" is empty; "   " too when split into no sentence or when SentencePiece drops the whitespace
        assert empty == ([2, 3] if split or name == "SentencePieceTokenizer" else [2])
    if split:
        assert len(dataset) > len(records)  # sentences are sequences


@pytest.mark.parametrize("partitions, sequential", [(3, False), (3, True), (10, False)])
def test_partitions_same_bytes_as_megatron_lm(tmp_path, tokenizers, partitions, sequential):
    options, reference = tokenizers("byte-level")
    lines = [json.dumps({"text": text}) + "\n" for text in DOCUMENTS]
    dataset, empty = assert_same_files(tmp_path, lines, options, reference, True, True, partitions, sequential)
    assert dataset.document_indices.shape == (len(DOCUMENTS) + 1,)
    assert len(empty) == 2  # "" and "   " have no sentence, wherever their partition puts them

"""SFT data: answer-only loss mask (on the mask and on the gradient), chat records, bad input; packed sequences
(rows, loss mask, resuming, options; the model side is tests/models/test_packed_sequences.py)."""

import json

import pytest
import torch

from nemo_ckpt.data.sft import FineTuningDataModule, PackedSequenceSpecs, SFTDataset, first_fit, read_jsonl
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.options import UnknownOptionError, UnsupportedOptionError
from nemo_ckpt.strategy import MegatronStrategy
from tests.helpers.trainer import build_trainer


def dataset(records, seq_length=24, **kwargs) -> SFTDataset:
    options = {"prompt_template": "Q: {input}\nA: ", "message_template": "{role}: {content}\n", "seed": 0}
    return SFTDataset(records, ByteLevelTokenizer(), seq_length, len(records), **{**options, **kwargs})


def test_loss_mask_covers_the_answer_and_end_of_document_only():
    sample = dataset([{"input": "2+2", "output": "4"}])[0]
    prompt = list(b"Q: 2+2\nA: ")
    expected = torch.tensor(prompt + [ord("4"), 256] + [256] * (25 - len(prompt) - 2))
    torch.testing.assert_close(torch.cat([sample["tokens"][:1], sample["labels"]]), expected)
    # label t is token t + 1: the answer "4" and the closing end-of-document are the only trained labels
    answer_at = len(prompt) - 1
    expected_mask = torch.zeros(24)
    expected_mask[answer_at : answer_at + 2] = 1
    torch.testing.assert_close(sample["loss_mask"], expected_mask)


def test_chat_messages_train_on_assistant_turns_only():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok"},
    ]
    sample = dataset([{"messages": messages}], seq_length=64)[0]
    labels, mask = sample["labels"], sample["loss_mask"].bool()
    trained = bytes(int(t) for t in labels[mask] if t < 256).decode()
    assert trained == "assistant: yo\nassistant: ok\n"


def test_prompt_tokens_get_no_gradient():
    torch.manual_seed(0)
    model = GPTModel(gpt_config("tiny", vocab_size=260))
    model.configure_model()
    samples = dataset([{"input": "abc", "output": "xyz"}, {"input": "hello", "output": "w"}])
    batch = {key: torch.stack([samples[0][key], samples[1][key]]) for key in samples[0]}
    captured = {}

    def keep_logits(module, inputs, logits):
        logits.retain_grad()
        captured["logits"] = logits

    model.module.output_layer.register_forward_hook(keep_logits)
    model.loss(batch).backward()
    grad = captured["logits"].grad
    per_position = grad.abs().sum(-1)
    assert torch.all(per_position[batch["loss_mask"] == 0] == 0)
    assert torch.all(per_position[batch["loss_mask"] == 1] > 0)


def test_truncates_to_seq_length():
    sample = dataset([{"input": "x" * 50, "output": "y"}], seq_length=8)[0]
    assert sample["tokens"].shape == (8,) and not sample["loss_mask"].any()


def test_bad_input_names_file_and_line(tmp_path):
    (tmp_path / "training.jsonl").write_text(json.dumps({"input": "a", "output": "b"}) + "\n" + '{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"training.jsonl:2: a record needs"):
        read_jsonl(tmp_path / "training.jsonl")
    with pytest.raises(FileNotFoundError, match="no training.jsonl"):
        FineTuningDataModule(dataset_root=str(tmp_path / "missing"), tokenizer="byte-level")


PAIRS = [{"input": "a", "output": "b"}, {"input": "cd", "output": "e"}, {"input": "xyz", "output": "w"}]


def packed(records, seq_length=8, packed_sequence_size=10, **kwargs) -> SFTDataset:
    options = {"prompt_template": "{input}|", "message_template": "{role}: {content}\n", "seed": 0}
    specs = PackedSequenceSpecs(packed_sequence_size=packed_sequence_size)
    return SFTDataset(
        records, ByteLevelTokenizer(), seq_length, None, **{**options, **kwargs}, packed_sequence_specs=specs
    )


def test_first_fit_puts_each_length_into_the_first_bin_with_room():
    assert first_fit([3, 4, 2, 5, 1], 6) == [[0, 2, 4], [1], [3]]
    assert first_fit([6, 6, 0], 6) == [[0, 2], [1]]
    assert first_fit([], 6) == []


def test_packed_row_holds_samples_with_their_own_positions_and_segments():
    data = packed(PAIRS)
    # records in the seeded shuffle [0, 1, 2] take 3 ("a|b" + eod), 4 ("cd|e" + eod) and 5 positions: 3 + 4 <= 10
    assert data.packs == [[0, 1], [2]] and len(data) == 2
    row = next(data[index] for index in range(2) if data[index]["tokens"][0] == ord("a"))
    a, b, bar, c, d, e, eod = 97, 98, 124, 99, 100, 101, 256
    assert row["tokens"].tolist() == [a, bar, b, c, d, bar, e, eod, eod, eod]
    assert row["labels"].tolist() == [bar, b, eod, d, bar, e, eod, eod, eod, eod]
    assert row["loss_mask"].tolist() == [0, 1, 1, 0, 0, 1, 1, 0, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    assert row["segment_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert {key: value.dtype for key, value in row.items()} == {
        "tokens": torch.long,
        "labels": torch.long,
        "loss_mask": torch.float32,
        "position_ids": torch.long,
        "segment_ids": torch.long,
    }


def test_packed_rows_train_on_answers_only():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    records = [*PAIRS, {"messages": messages}, {"input": "long prompt", "output": "fg"}]
    data = packed(records, seq_length=32, packed_sequence_size=40)
    assert sorted(index for pack in data.packs for index in pack) == list(range(5))
    trained = []
    for index in range(len(data)):
        row = data[index]
        mask = row["loss_mask"].bool()
        for segment in row["segment_ids"].unique().tolist():
            labels = row["labels"][mask & (row["segment_ids"] == segment)].tolist()
            if labels:  # not the padding segment
                assert labels[-1] == 256 and 256 not in labels[:-1]  # one closing end-of-document per sample
                trained.append(bytes(labels[:-1]).decode())
    assert sorted(trained) == sorted(["b", "e", "w", "fg", "assistant: yo\n"])


def test_packed_sample_longer_than_seq_length_is_cut_like_unpacked():
    records = [{"input": "x" * 50, "output": "y"}, {"input": "a", "output": "b"}]
    data = packed(records, seq_length=8, packed_sequence_size=12)
    assert data.packs == [[1, 0]]
    row = data[0]
    assert row["segment_ids"].tolist() == [0] * 3 + [1] * 8 + [2]  # "a|b" + eod, then 8 of the long one's 53
    plain = dataset(records, seq_length=8, prompt_template="{input}|")
    long_plain = next(plain[index] for index in range(2) if plain[index]["tokens"][0] == ord("x"))
    for key in ("tokens", "labels", "loss_mask"):
        assert torch.equal(row[key][3:11], long_plain[key]), key
    assert row["position_ids"].tolist() == [0, 1, 2, *range(8), 0]
    assert row["loss_mask"].tolist() == [0, 1, 1] + [0] * 9


def write_records(root, count=40):
    root.mkdir()
    lines = [json.dumps({"input": "q" * (i % 7 + 1), "output": str(i)}) for i in range(count)]
    (root / "training.jsonl").write_text("\n".join(lines) + "\n")
    return str(root)


def packed_module(root) -> FineTuningDataModule:
    specs = PackedSequenceSpecs(packed_sequence_size=32)
    data = FineTuningDataModule(
        root, "byte-level", 16, micro_batch_size=2, global_batch_size=2, packed_sequence_specs=specs
    )
    data.trainer = build_trainer(max_steps=12, limit_val_batches=1.0)  # Lightning's default; no validation file: off
    data.setup("fit")
    return data


def test_packed_data_resumes_at_consumed_samples(tmp_path):
    root = write_records(tmp_path / "sft")
    fresh = packed_module(root)
    packs = fresh.train_set.packs
    assert sorted(index for pack in packs for index in pack) == list(range(40))
    assert len(fresh.train_set) == 24 and len(packs) < 12  # 24 packs drawn: over more than one epoch of packs
    reference = list(fresh.train_dataloader())
    assert len(reference) == 12 and all(batch["segment_ids"].shape == (2, 32) for batch in reference)
    assert not all(torch.equal(reference[0]["tokens"], batch["tokens"]) for batch in reference[1:])

    resumed = packed_module(root)  # re-created, as in a new process: packs and order rebuilt from records and seed
    assert resumed.train_set.packs == packs
    loader = resumed.train_dataloader()
    loader.load_state_dict({"consumed_samples": 14})  # what Lightning restores at global_step 7
    for expected, batch in zip(reference[7:], loader, strict=True):
        assert batch.keys() == expected.keys()
        for key in expected:
            assert torch.equal(batch[key], expected[key]), key


def test_packing_option_errors(tmp_path):
    root = write_records(tmp_path / "sft", count=2)
    with pytest.raises(ValueError, match=r"packed_sequence_size=0\): use -1 .* packed_sequence_specs=None"):
        PackedSequenceSpecs(packed_sequence_size=0)
    with pytest.raises(ValueError, match=r"packed_sequence_size='64'"):
        PackedSequenceSpecs(packed_sequence_size="64")
    with pytest.raises(
        UnknownOptionError, match="unknown option `packed_seq_size`; did you mean `packed_sequence_size`"
    ):
        PackedSequenceSpecs(packed_seq_size=64)
    with pytest.raises(UnsupportedOptionError, match="not supported: packed_train_data_path .*packed offline"):
        PackedSequenceSpecs(packed_train_data_path="train.npy")
    with pytest.raises(ValueError, match=r"packed_sequence_size=8\) is shorter than seq_length=16"):
        FineTuningDataModule(root, seq_length=16, packed_sequence_specs=PackedSequenceSpecs(8))
    with pytest.raises(TypeError, match=r"pass a PackedSequenceSpecs"):
        FineTuningDataModule(root, packed_sequence_specs={"packed_sequence_size": 64})
    assert PackedSequenceSpecs().pack_size(16) == 16 and PackedSequenceSpecs(20).pack_size(16) == 20


@pytest.mark.parametrize("parallelism", ["context_parallel_size", "pipeline_model_parallel_size"])
def test_packing_refuses_context_and_pipeline_parallelism(tmp_path, parallelism):
    root = write_records(tmp_path / "sft", count=2)
    data = FineTuningDataModule(root, "byte-level", 16, 1, 1, packed_sequence_specs=PackedSequenceSpecs())
    strategy = MegatronStrategy(**{parallelism: 2})
    data.trainer = build_trainer(strategy, max_steps=1)
    with pytest.raises(
        ValueError, match=rf"not supported with {parallelism}=2: use {parallelism}=1, or packed_sequence"
    ):
        data.setup("fit")


def test_no_validation_file_turns_validation_off_without_lightning_warnings(tmp_path, recwarn):
    root = write_records(tmp_path / "sft")
    data = FineTuningDataModule(root, "byte-level", 16, micro_batch_size=2, global_batch_size=2)
    trainer = build_trainer(max_steps=2, val_check_interval=1, limit_val_batches=2)
    trainer.fit(GPTModel(gpt_config("tiny", vocab_size=384, seq_length=16)), datamodule=data)
    assert trainer.global_step == 2 and trainer.limit_val_batches == 0
    assert not [str(warning.message) for warning in recwarn if "across ranks is zero" in str(warning.message)]

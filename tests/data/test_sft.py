"""SFT data: answer-only loss mask (on the mask and on the gradient), chat records, bad input."""

import json

import pytest
import torch

from nemo_ckpt.data.sft import FineTuningDataModule, SFTDataset, read_jsonl
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.models import GPTModel, gpt_config


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

"""`FineTuningDataModule`: supervised fine-tuning (SFT) data from JSONL files, like NeMo's
`llm.FineTuningDataModule`, with the loss on the answer tokens only.

`dataset_root` holds `training.jsonl` and, optionally, `validation.jsonl`. Each line is either

    {"input": "What is 2+2?", "output": "4"}              rendered through `prompt_template`, then the output
    {"messages": [{"role": "user", "content": ...},      each message rendered as `message_template`; the
                  {"role": "assistant", "content": ...}]}  assistant messages are the answers

A sample is `prompt ids + answer ids + end-of-document`, cut to `seq_length + 1` tokens and padded with the
end-of-document id; `tokens`/`labels` are that sequence shifted by one, and `loss_mask` is 1 where the label is
an answer token (or the closing end-of-document), 0 on prompt and padding. Samples are drawn in a seeded shuffle
per epoch, so a resumed run (at sample `global_step * global_batch_size`) sees what an uninterrupted one would.
"""

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.data.sampler import ResumableDataLoader, rank_sampler, set_gradient_accumulation
from nemo_ckpt.data.tokenizer import Tokenizer, get_tokenizer

TRAINING_FILE = "training.jsonl"
VALIDATION_FILE = "validation.jsonl"
ANSWER_ROLES = ("assistant",)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file; each must hold `input` and `output`, or `messages`."""
    records = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} is not JSON: {error}") from None
            is_pair = isinstance(record, dict) and "input" in record and "output" in record
            is_chat = isinstance(record, dict) and isinstance(record.get("messages"), list)
            if not (is_pair or is_chat):
                raise ValueError(
                    f'{path}:{line_number}: a record needs "input" and "output", or "messages" '
                    f"(got keys {sorted(record) if isinstance(record, dict) else type(record).__name__})"
                )
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


class SFTDataset(Dataset):
    """Tokenized SFT samples (`tokens`, `labels`, `loss_mask`) of fixed length `seq_length`; their positions are
    the model's default 0..seq_length-1 (only packed sequences would need `position_ids`).

    Index i of `num_samples` is record `order[i % len(records)]`, the order reshuffled every epoch from `seed`.
    """

    def __init__(
        self,
        records: list[dict[str, Any]],
        tokenizer: Tokenizer,
        seq_length: int,
        num_samples: int,
        prompt_template: str,
        message_template: str,
        seed: int,
    ) -> None:
        self.records = records
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.prompt_template = prompt_template
        self.message_template = message_template
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def segments(self, record: dict[str, Any]) -> list[tuple[str, bool]]:
        """The record's text pieces in order, each with whether it is an answer (trained on)."""
        if "messages" in record:
            return [
                (self.message_template.format(role=m["role"], content=m["content"]), m["role"] in ANSWER_ROLES)
                for m in record["messages"]
            ]
        return [(self.prompt_template.format(**record), False), (str(record["output"]), True)]

    def _record_index(self, index: int) -> int:
        epoch, position = divmod(index, len(self.records))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return int(torch.randperm(len(self.records), generator=generator)[position])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, answer = [], []
        for text, is_answer in self.segments(self.records[self._record_index(index)]):
            piece = self.tokenizer.text_to_ids(text)
            ids += piece
            answer += [is_answer] * len(piece)
        ids.append(self.tokenizer.eod)
        answer.append(True)
        ids, answer = ids[: self.seq_length + 1], answer[: self.seq_length + 1]
        padding = self.seq_length + 1 - len(ids)
        ids += [self.tokenizer.eod] * padding
        answer += [False] * padding
        sequence = torch.tensor(ids, dtype=torch.long)
        return {
            "tokens": sequence[:-1],
            "labels": sequence[1:],
            "loss_mask": torch.tensor(answer[1:], dtype=torch.float32),
        }


class FineTuningDataModule(pl.LightningDataModule):
    """SFT data from `dataset_root` (`training.jsonl`, optional `validation.jsonl`), tokenized with `tokenizer`
    (a local Hugging Face tokenizer directory such as an imported checkpoint's `context/hf`, a SentencePiece
    `.model` or `byte-level`); None: the one stored with the checkpoint `finetune` restores
    (`RestoreConfig(load_artifacts=True)`)."""

    def __init__(
        self,
        dataset_root: str,
        tokenizer: str | None = None,
        seq_length: int = 2048,
        micro_batch_size: int = 4,
        global_batch_size: int = 8,
        prompt_template: str = "{input}\n",
        message_template: str = "{role}: {content}\n",
        num_val_samples: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.dataset_root = Path(dataset_root)
        self.tokenizer_path = tokenizer
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.prompt_template = prompt_template
        self.message_template = message_template
        self.num_val_samples = num_val_samples
        self.seed = seed
        self.num_workers = num_workers
        if not (self.dataset_root / TRAINING_FILE).is_file():
            raise FileNotFoundError(
                f"FineTuningDataModule(dataset_root={dataset_root!r}) has no {TRAINING_FILE}: put the training "
                'records there, one JSON object per line ({"input": ..., "output": ...} or {"messages": [...]})'
            )

    def _dataset(self, path: Path, num_samples: int | None, seed: int) -> SFTDataset:
        records = read_jsonl(path)
        return SFTDataset(
            records,
            self.tokenizer,
            self.seq_length,
            num_samples or len(records),
            self.prompt_template,
            self.message_template,
            seed,
        )

    def setup(self, stage: str = "") -> None:
        set_gradient_accumulation(self.trainer, self.micro_batch_size, self.global_batch_size, "FineTuningDataModule")
        if self.tokenizer_path is None:
            raise ValueError(
                "FineTuningDataModule(tokenizer=None): name a tokenizer, or fine-tune with "
                "RestoreConfig(load_artifacts=True) from a checkpoint that stores one (an imported Hugging Face model)"
            )
        self.tokenizer = get_tokenizer(self.tokenizer_path)
        num_train = max(1, self.trainer.max_steps) * self.global_batch_size
        self.train_set = self._dataset(self.dataset_root / TRAINING_FILE, num_train, self.seed)
        validation = self.dataset_root / VALIDATION_FILE
        self.val_set = self._dataset(validation, self.num_val_samples, self.seed + 1) if validation.is_file() else None

    def _loader(self, dataset: Dataset, consumed_samples: int) -> DataLoader:
        sampler = rank_sampler(self.trainer, len(dataset), consumed_samples, self.micro_batch_size)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=self.num_workers)

    def _consumed_samples(self) -> int:
        return self.trainer.global_step * self.global_batch_size

    def train_dataloader(self) -> DataLoader:
        sampler = rank_sampler(self.trainer, len(self.train_set), self._consumed_samples(), self.micro_batch_size)
        return ResumableDataLoader(
            self.train_set, batch_sampler=sampler, num_workers=self.num_workers, consumed_samples=self._consumed_samples
        )

    def val_dataloader(self) -> DataLoader | list:
        return [] if self.val_set is None else self._loader(self.val_set, 0)

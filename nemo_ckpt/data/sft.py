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

With `packed_sequence_specs=PackedSequenceSpecs()` (NeMo's sequence packing), a sample is instead a row of
`packed_sequence_size` tokens holding several records: each record's `tokens`/`labels`/`loss_mask` as above
(cut to `seq_length`, unpadded), its `position_ids` restarting at 0 and its own `segment_ids` value, from which
the model builds a block-diagonal causal attention mask; the row's padding is one more segment, without loss.
The packs are made once per data set (records in a seeded shuffle, each put into the first pack with room) and
drawn in a seeded shuffle per epoch, so resuming works as without packing.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.data.base import SampledDataModule
from nemo_ckpt.data.tokenizer import Tokenizer, get_tokenizer
from nemo_ckpt.options import strict_options
from nemo_ckpt.parallel.config import parallelism_of

TRAINING_FILE = "training.jsonl"
VALIDATION_FILE = "validation.jsonl"
ANSWER_ROLES = ("assistant",)
PACKING_UNSUPPORTED = {
    "tokenizer_model_name": "the tokenizer's name, which NeMo's llm.finetune sets to name its packed .npy files; "
    "packs here are built in memory with the data module's tokenizer",
    "packed_train_data_path": "a .npy file of training sequences packed offline beforehand; packs here are built "
    "in memory when the data module is set up",
    "packed_val_data_path": "a .npy file of validation sequences packed offline beforehand; packs here are built "
    "in memory when the data module is set up",
    "packed_metadata_path": "a JSON file of statistics written by NeMo's offline packing",
    "pad_cu_seqlens": "cu_seqlens padded to a fixed length for CUDA graphs (Transformer Engine's THD format); "
    "sample boundaries here are per-token segment_ids",
    "num_tokenizer_workers": "worker processes of NeMo's offline tokenization before packing",
}


@strict_options(PACKING_UNSUPPORTED)
@dataclass
class PackedSequenceSpecs:
    """Sequence packing for `FineTuningDataModule` (NeMo's name): several samples per row of
    `packed_sequence_size` tokens, each with positions from 0 and attention only within itself.

    `packed_sequence_size`: tokens per packed row; -1 (the default): the data module's `seq_length`. As in NeMo,
    `seq_length` stays the longest a sample may be (longer ones are cut), so a pack must be at least that long.
    """

    packed_sequence_size: int = -1

    def __post_init__(self) -> None:
        size = self.packed_sequence_size
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ValueError(
                f"PackedSequenceSpecs(packed_sequence_size={size!r}): use -1 (packs of seq_length tokens) or a "
                "positive number of tokens per pack; to turn packing off, pass packed_sequence_specs=None"
            )

    def pack_size(self, seq_length: int) -> int:
        """Tokens per packed row for samples of at most `seq_length` tokens, or a clear error."""
        if self.packed_sequence_size == -1:
            return seq_length
        if self.packed_sequence_size < seq_length:
            raise ValueError(
                f"PackedSequenceSpecs(packed_sequence_size={self.packed_sequence_size}) is shorter than "
                f"seq_length={seq_length}, the longest a sample may be: set packed_sequence_size >= seq_length, "
                "or -1 (packs of seq_length tokens), or lower seq_length"
            )
        return self.packed_sequence_size


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """The indices of `lengths` (each at most `capacity`) in bins of at most `capacity` in total: each goes into
    the first bin with room, found in a max-tree over the bins' free space (log time per item)."""
    leaves = 1
    while leaves < len(lengths):
        leaves *= 2
    free = [capacity] * (2 * leaves)  # node k: the most free space of the bins under it; leaf `leaves + j`: bin j
    bins: list[list[int]] = []
    for index, length in enumerate(lengths):
        node = 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        if node - leaves == len(bins):
            bins.append([])
        bins[node - leaves].append(index)
        free[node] -= length
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return bins


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
    the model's default 0..seq_length-1.

    Index i of `num_samples` (None: one epoch) is record `order[i % len(records)]`, the order reshuffled every
    epoch from `seed`. With `packed_sequence_specs`, index i is a pack of records (`packs`, made once) in the same
    kind of per-epoch order, and samples gain `position_ids` and `segment_ids` (see the module's docstring).
    """

    def __init__(
        self,
        records: list[dict[str, Any]],
        tokenizer: Tokenizer,
        seq_length: int,
        num_samples: int | None,
        prompt_template: str,
        message_template: str,
        seed: int,
        packed_sequence_specs: PackedSequenceSpecs | None = None,
    ) -> None:
        self.records = records
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.prompt_template = prompt_template
        self.message_template = message_template
        self.seed = seed
        self.pack_size = None if packed_sequence_specs is None else packed_sequence_specs.pack_size(seq_length)
        self.packs = None if self.pack_size is None else self._pack()
        self.num_samples = num_samples or len(self.packs or records)

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

    def _permutation(self, count: int, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(count, generator=generator)

    def _shuffled_index(self, index: int, count: int) -> int:
        epoch, position = divmod(index, count)
        return int(self._permutation(count, epoch)[position])

    def _sample(self, record: dict[str, Any]) -> tuple[list[int], list[bool]]:
        """The record's token ids (its pieces, then end-of-document) cut to `seq_length + 1`, and which of them
        are answer tokens."""
        ids, answer = [], []
        for text, is_answer in self.segments(record):
            piece = self.tokenizer.text_to_ids(text)
            ids += piece
            answer += [is_answer] * len(piece)
        ids.append(self.tokenizer.eod)
        answer.append(True)
        return ids[: self.seq_length + 1], answer[: self.seq_length + 1]

    def _pack(self) -> list[list[int]]:
        """The record indices of each pack: the records in a seeded shuffle (epoch -1 of `seed`), each put into
        the first pack with room for its tokens (`first_fit`)."""
        order = self._permutation(len(self.records), epoch=-1).tolist()
        lengths = [len(self._sample(self.records[index])[0]) - 1 for index in order]
        return [[order[position] for position in pack] for pack in first_fit(lengths, self.pack_size)]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.packs is not None:
            return self._packed_item(self.packs[self._shuffled_index(index, len(self.packs))])
        ids, answer = self._sample(self.records[self._shuffled_index(index, len(self.records))])
        padding = self.seq_length + 1 - len(ids)
        ids += [self.tokenizer.eod] * padding
        answer += [False] * padding
        sequence = torch.tensor(ids, dtype=torch.long)
        return {
            "tokens": sequence[:-1],
            "labels": sequence[1:],
            "loss_mask": torch.tensor(answer[1:], dtype=torch.float32),
        }

    def _packed_item(self, pack: list[int]) -> dict[str, torch.Tensor]:
        """The records of `pack` in one row of `pack_size` tokens; segment `len(pack)` is the padding."""
        tokens, labels, answer, positions, segments = [], [], [], [], []
        for segment, record_index in enumerate(pack):
            ids, is_answer = self._sample(self.records[record_index])
            tokens += ids[:-1]
            labels += ids[1:]
            answer += is_answer[1:]
            positions += range(len(ids) - 1)
            segments += [segment] * (len(ids) - 1)
        padding = self.pack_size - len(tokens)
        return {
            "tokens": torch.tensor(tokens + [self.tokenizer.eod] * padding, dtype=torch.long),
            "labels": torch.tensor(labels + [self.tokenizer.eod] * padding, dtype=torch.long),
            "loss_mask": torch.tensor(answer + [False] * padding, dtype=torch.float32),
            "position_ids": torch.tensor(positions + list(range(padding)), dtype=torch.long),
            "segment_ids": torch.tensor(segments + [len(pack)] * padding, dtype=torch.long),
        }


class FineTuningDataModule(SampledDataModule):
    """SFT data from `dataset_root` (`training.jsonl`, optional `validation.jsonl`), tokenized with `tokenizer`
    (a local Hugging Face tokenizer directory such as an imported checkpoint's `context/hf`, a SentencePiece
    `.model` or `byte-level`); None: the one stored with the checkpoint `finetune` restores
    (`RestoreConfig(load_artifacts=True)`).

    `packed_sequence_specs` (e.g. `PackedSequenceSpecs()`): several samples per row (sequence packing); a sample
    is then a pack, so `global_batch_size` counts packs. Not with pipeline or context parallelism.
    """

    def __init__(
        self,
        dataset_root: str,
        tokenizer: str | None = None,
        seq_length: int = 2048,
        micro_batch_size: int = 4,
        global_batch_size: int | None = 8,
        prompt_template: str = "{input}\n",
        message_template: str = "{role}: {content}\n",
        num_val_samples: int | None = None,
        seed: int = 1234,
        num_workers: int = 0,
        packed_sequence_specs: PackedSequenceSpecs | None = None,
    ) -> None:
        super().__init__(micro_batch_size, global_batch_size, num_workers)
        self.dataset_root = Path(dataset_root)
        self.tokenizer_path = tokenizer
        self.seq_length = seq_length
        self.prompt_template = prompt_template
        self.message_template = message_template
        self.num_val_samples = num_val_samples
        self.seed = seed
        self.packed_sequence_specs = packed_sequence_specs
        self._tokenizer: tuple[str, Tokenizer] | None = None
        if packed_sequence_specs is not None and not isinstance(packed_sequence_specs, PackedSequenceSpecs):
            raise TypeError(
                f"FineTuningDataModule(packed_sequence_specs={packed_sequence_specs!r}): pass a PackedSequenceSpecs "
                "(e.g. PackedSequenceSpecs(packed_sequence_size=-1)) to pack samples, or None"
            )
        if packed_sequence_specs is not None:
            packed_sequence_specs.pack_size(seq_length)
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
            num_samples,
            self.prompt_template,
            self.message_template,
            seed,
            self.packed_sequence_specs,
        )

    def _check_packing_parallelism(self) -> None:
        parallelism = parallelism_of(self.trainer)
        sizes = {
            "context_parallel_size": parallelism.context_parallel_size,
            "pipeline_model_parallel_size": parallelism.pipeline_model_parallel_size,
        }
        for name, size in sizes.items():
            if size > 1:
                raise ValueError(
                    f"FineTuningDataModule(packed_sequence_specs=...) is not supported with {name}={size}: "
                    f"use {name}=1, or packed_sequence_specs=None"
                )

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer `tokenizer_path` names (loaded once per path: `RestoreConfig` may replace the path)."""
        if self.tokenizer_path is None:
            raise ValueError(
                "FineTuningDataModule(tokenizer=None): name a tokenizer, or fine-tune with "
                "RestoreConfig(load_artifacts=True) from a checkpoint that stores one (an imported Hugging Face model)"
            )
        path = str(self.tokenizer_path)
        if self._tokenizer is None or self._tokenizer[0] != path:
            self._tokenizer = (path, get_tokenizer(path))
        return self._tokenizer[1]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def vocab_source(self) -> str:
        return f"FineTuningDataModule(tokenizer={str(self.tokenizer_path)!r})"

    def setup(self, stage: str = "") -> None:
        if self.packed_sequence_specs is not None:
            self._check_packing_parallelism()
        super().setup(stage)
        self.train_set = self._dataset(self.dataset_root / TRAINING_FILE, self.train_samples(), self.seed)
        validation = self.dataset_root / VALIDATION_FILE
        self.val_set = self._dataset(validation, self.num_val_samples, self.seed + 1) if validation.is_file() else None
        if self.val_set is None:
            self.without_validation(f"{validation} does not exist")

    def train_dataloader(self) -> DataLoader:
        self.train_set.num_samples = max(len(self.train_set), self.train_samples())  # a resumed run's last steps
        return self.train_loader(self.train_set)

    def val_dataloader(self) -> DataLoader | list:
        return [] if self.val_set is None else self.eval_loader(self.val_set)

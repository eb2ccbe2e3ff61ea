"""Megatron-Core's `GPTDataset`: `seq_length + 1`-token samples drawn across the documents of an indexed dataset.

Three index arrays decide the samples, built exactly as megatron-core builds them (same seed, same order):
- the document index: the split's document ids repeated once per epoch, shuffled (`numpy.random.RandomState`);
- the sample index: `(position in the document index, token offset)` where each sample starts; samples are consecutive
  windows of the concatenated document stream, overlapping by the one extra token that becomes the last label;
- the shuffle index: a permutation of the samples.
They are cached as `.npy` files next to the data (`<prefix>/cache/GPTDataset_indices/`) or in `path_to_cache`, keyed by
a hash of everything they depend on, built once by rank 0 and reused by later runs.
"""

import math
import os
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from torch.utils.data import Dataset

from nemo_ckpt.data.index_cache import load_or_build
from nemo_ckpt.data.indexed_dataset import IndexedDataset, get_idx_path

PAD_TOKEN_ID = -1


class Split(Enum):
    train = 0
    valid = 1
    test = 2


@dataclass
class GPTDatasetConfig:
    """Megatron-Core's `GPTDatasetConfig` fields that change the samples (`sequence_length` is `seq_length`)."""

    seq_length: int
    eod: int
    random_seed: int = 1234
    add_extra_token_to_sequence: bool = True
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = False
    drop_last_partial_validation_sequence: bool = True
    path_to_cache: str | None = None

    def __post_init__(self) -> None:
        if self.seq_length < 2:
            raise ValueError(f"GPTDatasetConfig: seq_length={self.seq_length} must be at least 2")


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """`"969,30,1"` -> the train/valid/test bookends `[(0, .969), (.969, .999), (.999, 1)]` (None for a 0 weight)."""
    try:
        weights = [float(part) for part in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"split={split!r}: expected up to three comma-separated weights, e.g. '969,30,1'") from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split={split!r}: expected up to three non-negative weights with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = np.cumsum([0.0] + [w / total for w in weights]).tolist()
    return [(bounds[i], bounds[i + 1]) if bounds[i + 1] > bounds[i] else None for i in range(3)]


def split_documents(num_sequences: int, bookends: tuple[float, float]) -> np.ndarray:
    """The sequence ids of one split: `round(begin * N):round(end * N)`, as Megatron-Core splits."""
    begin, end = (int(round(bound * float(num_sequences))) for bound in bookends)
    return np.arange(begin, end, dtype=np.int32)


def build_document_index(
    documents: np.ndarray, num_epochs: int, random_state: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`documents` once per epoch, shuffled (the last epoch separately when `separate_final_epoch`)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.tile(documents.astype(np.int32), num_epochs)
        random_state.shuffle(document_index)
        return document_index
    first = build_document_index(documents, num_epochs - 1, random_state, False)
    last = build_document_index(documents, 1, random_state, False)
    return np.concatenate((first, last))


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> np.ndarray:
    """Rows `(i, offset)`: sample `k` starts at token `offset` of document `document_index[i]` (Megatron-Core's C++
    `build_sample_idx`, vectorised): the first document whose end passes sample k's end plus the extra token."""
    extra = int(add_extra_token_to_sequence)
    tokens = num_epochs * tokens_per_epoch - extra
    num_samples = tokens // seq_length if drop_last_partial_sequence else math.ceil(tokens / seq_length)
    largest = max(document_index.shape[0], int(sequence_lengths.max()))
    dtype = np.int32 if largest <= np.iinfo(np.int32).max else np.int64
    lengths = np.take(np.array(sequence_lengths), document_index)  # gathering from memory beats the memory map
    ends = np.cumsum(lengths, dtype=np.int64)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    rows = np.searchsorted(ends, positions + extra, side="left")
    past_end = rows >= len(ends)
    rows[past_end] = len(ends) - 1
    offsets = positions - (ends[rows] - lengths[rows])
    offsets[past_end] = int(lengths[-1]) - extra
    sample_index = np.stack([rows, offsets], axis=1).astype(dtype)
    sample_index[0] = 0
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, random_state: np.random.RandomState) -> np.ndarray:
    """A permutation of `[0, num_samples)` followed by one of `[num_samples, total_size)`."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return np.concatenate((first, last))


def masks_and_position_ids(
    tokens: torch.Tensor, config: GPTDatasetConfig
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Megatron's left-to-right attention mask (True = masked), loss mask and position ids of one sample."""
    seq_length = tokens.numel()
    attention_mask = (
        torch.tril(torch.ones(seq_length, seq_length)).unsqueeze(0) if config.create_attention_mask else None
    )
    loss_mask = torch.ones(seq_length, dtype=torch.float)
    if config.eod_mask_loss:
        loss_mask[tokens == config.eod] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long)
    if config.reset_position_ids or config.reset_attention_mask:
        previous = 0
        for eod_position in torch.nonzero(tokens == config.eod).flatten().tolist():
            if config.reset_attention_mask and attention_mask is not None:
                attention_mask[0, eod_position + 1 :, : eod_position + 1] = 0
            if config.reset_position_ids:
                position_ids[eod_position + 1 :] -= eod_position + 1 - previous
                previous = eod_position + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


class GPTDataset(Dataset):
    """The samples of one split of an indexed dataset; `num_samples=None` means one epoch."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        document_ids: np.ndarray,
        num_samples: int | None,
        split: Split,
        config: GPTDatasetConfig,
    ) -> None:
        self.dataset = indexed_dataset
        self.document_ids = document_ids
        self.num_samples = num_samples
        self.split = split
        self.config = config
        self.extra = int(config.add_extra_token_to_sequence)
        self._masks_are_cacheable = not (
            config.reset_position_ids or config.reset_attention_mask or config.eod_mask_loss
        )
        self._cached_masks = None
        self.tokens_per_epoch = int(
            np.take(np.array(indexed_dataset.sequence_lengths), document_ids).sum(dtype=np.int64)
        )
        prefix = indexed_dataset.path_prefix
        if self.tokens_per_epoch < config.seq_length + self.extra:
            raise ValueError(
                f"The {split.name} split of {prefix} ({len(document_ids)} documents) holds {self.tokens_per_epoch} "
                f"tokens, fewer than one sample of seq_length + {self.extra} = {config.seq_length + self.extra}; "
                "use a shorter seq_length, more data, or a larger share for this split in `split`"
            )
        self.num_epochs = self._num_epochs()
        self.drop_last_partial_sequence = split != Split.valid or config.drop_last_partial_validation_sequence
        idx_path = get_idx_path(prefix)
        description = {
            "class": type(self).__name__,
            "dataset_path": os.path.abspath(prefix),
            "index_bytes": os.path.getsize(idx_path),
            "index_mtime_ns": os.stat(idx_path).st_mtime_ns,
            "documents": [int(document_ids[0]), int(document_ids[-1]) + 1] if len(document_ids) else [0, 0],
            "num_samples": num_samples,
            "index_split": split.name,
            "random_seed": config.random_seed,
            "sequence_length": config.seq_length,
            "add_extra_token_to_sequence": config.add_extra_token_to_sequence,
            "drop_last_partial_sequence": self.drop_last_partial_sequence,
        }
        self.description = description
        cache_dir = config.path_to_cache or os.path.join(prefix, "cache", f"{type(self).__name__}_indices")
        self.document_index, self.sample_index, self.shuffle_index = load_or_build(
            cache_dir,
            f"{type(self).__name__}-{split.name}",
            description,
            ("document_index", "sample_index", "shuffle_index"),
            self._build_indices,
        )

    def _num_epochs(self) -> int:
        if self.num_samples is None:
            return 1
        requested = self.num_samples * self.config.seq_length + self.extra
        return max(1, math.ceil(requested / self.tokens_per_epoch))

    def _build_indices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        seq_length, num_epochs = self.config.seq_length, self.num_epochs
        separate_final_epoch = False
        if num_epochs > 1:
            samples_before_final_epoch = ((num_epochs - 1) * self.tokens_per_epoch - self.extra) // seq_length
            samples_per_epoch = (self.tokens_per_epoch - self.extra) // seq_length
            samples_from_final_epoch = self.num_samples - samples_before_final_epoch
            separate_final_epoch = samples_from_final_epoch < int(0.80 * samples_per_epoch)
        random_state = np.random.RandomState(self.config.random_seed)
        document_index = build_document_index(self.document_ids, num_epochs, random_state, separate_final_epoch)
        sample_index = build_sample_index(
            self.dataset.sequence_lengths,
            document_index,
            seq_length,
            num_epochs,
            self.tokens_per_epoch,
            self.drop_last_partial_sequence,
            self.config.add_extra_token_to_sequence,
        )
        total = sample_index.shape[0] - 1
        first = samples_before_final_epoch if separate_final_epoch else total
        return document_index, sample_index, build_shuffle_index(first, total, random_state)

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def sample_tokens(self, index: int) -> np.ndarray:
        """The `seq_length + 1` token ids of sample `index` (padded with -1 past the end of the data)."""
        sample = int(self.shuffle_index[index])
        first, first_offset = (int(v) for v in self.sample_index[sample])
        last, last_offset = (int(v) for v in self.sample_index[sample + 1])
        parts = []
        for position in range(first, last + 1):
            offset = first_offset if position == first else 0
            length = last_offset - offset + self.extra if position == last else None
            parts.append(self.dataset.get(int(self.document_index[position]), offset=offset, length=length))
        tokens = np.concatenate(parts).astype(np.int64)
        missing = self.config.seq_length + self.extra - len(tokens)
        return np.concatenate([tokens, np.full(missing, PAD_TOKEN_ID, np.int64)]) if missing > 0 else tokens

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.sample_tokens(index))
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens, labels = text, torch.roll(text, shifts=-1)
            labels[-1] = PAD_TOKEN_ID
        if self._cached_masks is None:
            attention_mask, loss_mask, position_ids = masks_and_position_ids(tokens, self.config)
            if self._masks_are_cacheable:  # they do not depend on the tokens
                self._cached_masks = (attention_mask, loss_mask, position_ids)
        else:
            attention_mask, loss_mask, position_ids = self._cached_masks
        loss_mask = loss_mask.clone()
        loss_mask[labels == PAD_TOKEN_ID] = 0.0
        tokens[tokens == PAD_TOKEN_ID] = 0
        labels[labels == PAD_TOKEN_ID] = 0
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            sample["attention_mask"] = attention_mask
        return sample

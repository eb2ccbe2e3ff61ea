"""`PreTrainingDataModule`: NeMo's data module for Megatron indexed datasets (GPT samples, blends, splits).

A resumed run continues after the consumed samples stored in its checkpoint, through Megatron's pretraining sampler
(`SampledDataModule`).
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.data.base import SampledDataModule
from nemo_ckpt.data.blended_dataset import build_split_dataset, parse_blend
from nemo_ckpt.data.gpt_dataset import GPTDatasetConfig, Split, parse_split
from nemo_ckpt.data.indexed_dataset import IndexedDataset
from nemo_ckpt.data.tokenizer import Tokenizer, get_tokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask")
CHECKED_TOKENS = 1 << 20  # of each dataset, for ids the tokenizer cannot produce, before training starts


class TrainingBatchCollator:
    """Stack the keys `GPTModel` trains on, refusing token ids the tokenizer cannot have produced (data tokenized with
    another, larger tokenizer), which would index past the model's embedding."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([sample[key] for sample in samples]) for key in BATCH_KEYS}
        largest = int(torch.maximum(batch["tokens"].max(), batch["labels"].max()))
        if largest >= self.vocab_size:
            raise ValueError(
                f"the data holds token id {largest}, but its tokenizer has {self.vocab_size} tokens: the dataset was "
                "tokenized with another tokenizer; re-run preprocessing with this one, or pass the tokenizer it was "
                "made with"
            )
        return batch


class PreTrainingDataModule(SampledDataModule):
    """GPT pretraining on Megatron indexed datasets (NeMo's `llm.PreTrainingDataModule` arguments).

    `paths`: one path prefix (`.../out_text_document`), several (blended by size), `[weight, prefix, ...]` (blended by
    weight), or `{"train": ..., "validation": ..., "test": ...}` (one blend per split; `split` is then unused).
    `tokenizer`: a tokenizer object or a `get_tokenizer` name (`byte-level`, a local directory, a `.model` file); its
    end-of-document id drives `eod_mask_loss`. Index files are cached next to the data or in `index_mapping_dir`.
    The sampler shards by data-parallel rank itself: use it with `Trainer(use_distributed_sampler=False)`, as the
    recipes do. `global_batch_size=None`: one micro-batch per data-parallel rank. Batches hold `tokens`, `labels`
    and `loss_mask` (`GPTModel` averages the loss over the mask).
    `micro_batches_per_fetch`: training micro-batches a worker collates and hands over at once (split back into
    micro-batches in the training process; see `ResumableDataLoader`); more cuts the per-batch cost of workers.
    """

    def __init__(
        self,
        paths: str | Path | Sequence | dict[str, Any],
        seq_length: int = 2048,
        tokenizer: Tokenizer | str | None = None,
        micro_batch_size: int = 4,
        global_batch_size: int | None = 8,
        num_workers: int = 8,
        pin_memory: bool = True,
        persistent_workers: bool = False,
        reset_position_ids: bool = False,
        reset_attention_mask: bool = False,
        eod_mask_loss: bool = False,
        seed: int = 1234,
        split: str = "900,50,50",
        index_mapping_dir: str | None = None,
        add_extra_token_to_sequence: bool = True,
        micro_batches_per_fetch: int = 1,
    ) -> None:
        super().__init__(micro_batch_size, global_batch_size, num_workers)
        if reset_position_ids or reset_attention_mask:
            raise ValueError(
                "PreTrainingDataModule: reset_position_ids / reset_attention_mask need a model that takes "
                "position_ids and attention masks; GPTModel does not: leave them False"
            )
        if micro_batches_per_fetch < 1:
            raise ValueError(f"PreTrainingDataModule: micro_batches_per_fetch={micro_batches_per_fetch}; use 1 or more")
        self.micro_batches_per_fetch = micro_batches_per_fetch
        self.blends = self._parse_paths(paths, split)
        self.split = split
        self.tokenizer = get_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
        self.tokenizer_name = str(tokenizer) if isinstance(tokenizer, (str, Path)) else type(tokenizer).__name__
        if self.tokenizer is None:
            raise ValueError("PreTrainingDataModule: pass tokenizer= (an object or a get_tokenizer name or path)")
        self._check_datasets()
        self.seq_length = seq_length
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.config = GPTDatasetConfig(
            seq_length=seq_length,
            eod=self.tokenizer.eod,
            random_seed=seed,
            add_extra_token_to_sequence=add_extra_token_to_sequence,
            eod_mask_loss=eod_mask_loss,
            path_to_cache=index_mapping_dir,
        )
        self.datasets: dict[Split, Dataset | None] = {}

    @staticmethod
    def _parse_paths(paths, split: str) -> dict[Split, tuple[list[str], list[float] | None, str] | None]:
        if isinstance(paths, dict):
            names = {"train": Split.train, "validation": Split.valid, "valid": Split.valid, "test": Split.test}
            unknown = set(paths) - set(names)
            if unknown:
                raise ValueError(f"paths: unknown split keys {sorted(unknown)}; use train, validation and test")
            blends = {which: None for which in Split}
            for key, value in paths.items():
                which = names[key]
                whole = ",".join("1" if other == which else "0" for other in Split)  # all of it to this split
                blends[which] = (*parse_blend(value), whole)
            return blends
        parse_split(split)
        return {which: (*parse_blend(paths), split) for which in Split}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def vocab_source(self) -> str:
        return f"PreTrainingDataModule(tokenizer={self.tokenizer_name!r})"

    def _check_datasets(self) -> None:
        """Every prefix exists and is readable, its token dtype holds the tokenizer's vocabulary, and its first
        `CHECKED_TOKENS` tokens are ids of the tokenizer (the collator checks every batch in training)."""
        prefixes = {prefix for blend in self.blends.values() if blend for prefix in blend[0]}
        for prefix in sorted(prefixes):
            dataset = IndexedDataset(prefix)
            capacity = int(np.iinfo(dataset.dtype).max) + 1
            if self.vocab_size > capacity:
                raise ValueError(
                    f"{prefix}: its tokens are {np.dtype(dataset.dtype).name} (ids below {capacity}) but the "
                    f"tokenizer has {self.vocab_size} tokens; re-run preprocessing with this tokenizer"
                )
            head = dataset.head(CHECKED_TOKENS)
            if head.size and int(head.max()) >= self.vocab_size:
                raise ValueError(
                    f"{prefix} holds token id {int(head.max())}, but the tokenizer has {self.vocab_size} tokens: the "
                    "dataset was tokenized with another tokenizer; pass the tokenizer it was made with, or re-run "
                    "preprocessing with this one"
                )

    def _num_samples(self) -> dict[Split, int | None]:
        """NeMo's sizes: max_steps global batches to train; the validation batches every val_check_interval."""
        trainer = self.trainer
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise ValueError("PreTrainingDataModule needs trainer.max_steps > 0 to size the training samples")
        valid = None
        interval, limit = trainer.val_check_interval, trainer.limit_val_batches
        if isinstance(limit, int) and isinstance(interval, int) and interval > 0:
            valid = (trainer.max_steps // interval + 1) * limit * self.global_batch_size
        test = (
            trainer.limit_test_batches * self.global_batch_size if isinstance(trainer.limit_test_batches, int) else None
        )
        return {Split.train: self.train_samples(), Split.valid: valid, Split.test: test}

    def setup(self, stage: str = "") -> None:
        super().setup(stage)
        sizes = self._num_samples()
        needed = [Split.test] if stage == "test" else [Split.train, Split.valid]
        for which in needed:
            if which not in self.datasets:
                self._build(which, sizes[which])
        if stage != "test" and self.datasets[Split.valid] is None:
            self.without_validation(f"split={self.split!r} and paths give no validation data")

    def _build(self, which: Split, num_samples: int | None) -> None:
        blend = self.blends[which]
        if blend is None:
            self.datasets[which] = None
            return
        prefixes, weights, split = blend
        self.datasets[which] = build_split_dataset(prefixes, weights, split, which, num_samples, self.config)

    def _options(self) -> dict[str, Any]:
        return {
            "pin_memory": self.pin_memory and torch.cuda.is_available(),
            "persistent_workers": self.persistent_workers,
            "collate_fn": TrainingBatchCollator(self.vocab_size),
        }

    def train_dataloader(self) -> DataLoader | list:
        dataset = self.datasets[Split.train]
        if dataset is not None and len(dataset) < self.train_samples():  # resumed with a smaller global batch
            self._build(Split.train, self.train_samples())
            dataset = self.datasets[Split.train]
        if dataset is None:
            return []
        return self.train_loader(dataset, micro_batches_per_fetch=self.micro_batches_per_fetch, **self._options())

    def val_dataloader(self) -> DataLoader | list:
        dataset = self.datasets.get(Split.valid)
        return [] if dataset is None else self.eval_loader(dataset, **self._options())

    def test_dataloader(self) -> DataLoader | list:
        dataset = self.datasets.get(Split.test)
        return [] if dataset is None else self.eval_loader(dataset, **self._options())

"""`PreTrainingDataModule`: NeMo's data module for Megatron indexed datasets (GPT samples, blends, splits).

A resumed run continues at `consumed_samples` (`global_step * global_batch_size`) through Megatron's pretraining
sampler; its dataloaders carry that in `state_dict`, so Lightning treats them as resumable.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.data.blended_dataset import build_split_dataset, parse_blend
from nemo_ckpt.data.gpt_dataset import GPTDatasetConfig, Split, parse_split
from nemo_ckpt.data.indexed_dataset import IndexedDataset
from nemo_ckpt.data.sampler import ResumableDataLoader, rank_sampler, set_gradient_accumulation
from nemo_ckpt.data.tokenizer import Tokenizer, get_tokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask")


def collate_training_batch(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack the keys `GPTModel` trains on."""
    return {key: torch.stack([sample[key] for sample in samples]) for key in BATCH_KEYS}


class PreTrainingDataModule(pl.LightningDataModule):
    """GPT pretraining on Megatron indexed datasets (NeMo's `llm.PreTrainingDataModule` arguments).

    `paths`: one path prefix (`.../out_text_document`), several (blended by size), `[weight, prefix, ...]` (blended by
    weight), or `{"train": ..., "validation": ..., "test": ...}` (one blend per split; `split` is then unused).
    `tokenizer`: a tokenizer object or a `get_tokenizer` name (`byte-level`, a local directory, a `.model` file); its
    end-of-document id drives `eod_mask_loss`. Index files are cached next to the data or in `index_mapping_dir`.
    The sampler shards by data-parallel rank itself: use it with `Trainer(use_distributed_sampler=False)`, as the
    recipes do. Batches hold `tokens`, `labels` and `loss_mask` (`GPTModel` averages the loss over the mask).
    `micro_batches_per_fetch`: training micro-batches a worker collates and hands over at once (split back into
    micro-batches in the training process; see `ResumableDataLoader`); more cuts the per-batch cost of workers.
    """

    def __init__(
        self,
        paths: str | Path | Sequence | dict[str, Any],
        seq_length: int = 2048,
        tokenizer: Tokenizer | str | None = None,
        micro_batch_size: int = 4,
        global_batch_size: int = 8,
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
        super().__init__()
        if reset_position_ids or reset_attention_mask:
            raise ValueError(
                "PreTrainingDataModule: reset_position_ids / reset_attention_mask need a model that takes "
                "position_ids and attention masks; GPTModel does not: leave them False"
            )
        if micro_batch_size < 1 or global_batch_size < micro_batch_size:
            raise ValueError(
                f"PreTrainingDataModule: need 1 <= micro_batch_size ({micro_batch_size}) <= global_batch_size "
                f"({global_batch_size})"
            )
        if micro_batches_per_fetch < 1:
            raise ValueError(f"PreTrainingDataModule: micro_batches_per_fetch={micro_batches_per_fetch}; use 1 or more")
        self.micro_batches_per_fetch = micro_batches_per_fetch
        self.blends = self._parse_paths(paths, split)
        self.split = split
        self.tokenizer = get_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
        if self.tokenizer is None:
            raise ValueError("PreTrainingDataModule: pass tokenizer= (an object or a get_tokenizer name or path)")
        self._check_datasets()
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.num_workers = num_workers
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
        self.init_consumed_samples = 0
        self.init_global_step = 0
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

    def _check_datasets(self) -> None:
        """Every prefix exists and is readable, and its token dtype holds the tokenizer's vocabulary."""
        prefixes = {prefix for blend in self.blends.values() if blend for prefix in blend[0]}
        for prefix in sorted(prefixes):
            dataset = IndexedDataset(prefix)
            capacity = int(np.iinfo(dataset.dtype).max) + 1
            if self.tokenizer.vocab_size > capacity:
                raise ValueError(
                    f"{prefix}: its tokens are {np.dtype(dataset.dtype).name} (ids below {capacity}) but the "
                    f"tokenizer has {self.tokenizer.vocab_size} tokens; re-run preprocessing with this tokenizer"
                )

    def _num_samples(self) -> dict[Split, int | None]:
        """NeMo's sizes: max_steps global batches to train; the validation batches every val_check_interval."""
        trainer = self.trainer
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise ValueError("PreTrainingDataModule needs trainer.max_steps > 0 to size the training samples")
        train = trainer.max_steps * self.global_batch_size
        valid = None
        interval, limit = trainer.val_check_interval, trainer.limit_val_batches
        if isinstance(limit, int) and isinstance(interval, int) and interval > 0:
            valid = (trainer.max_steps // interval + 1) * limit * self.global_batch_size
        test = (
            trainer.limit_test_batches * self.global_batch_size if isinstance(trainer.limit_test_batches, int) else None
        )
        return {Split.train: train, Split.valid: valid, Split.test: test}

    def setup(self, stage: str = "") -> None:
        set_gradient_accumulation(self.trainer, self.micro_batch_size, self.global_batch_size, "PreTrainingDataModule")
        sizes = self._num_samples()
        needed = [Split.test] if stage == "test" else [Split.train, Split.valid]
        for which in needed:
            if which in self.datasets or self.blends[which] is None:
                self.datasets.setdefault(which, None)
                continue
            prefixes, weights, split = self.blends[which]
            self.datasets[which] = build_split_dataset(prefixes, weights, split, which, sizes[which], self.config)

    def consumed_samples(self) -> int:
        """Training samples consumed so far (over all data-parallel ranks)."""
        steps = self.trainer.global_step - self.init_global_step
        return self.init_consumed_samples + steps * self.global_batch_size

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader | list:
        """Training resumes after the consumed samples; validation and test always start at sample 0."""
        if dataset is None:
            return []
        consumed_samples = self.init_consumed_samples if train else 0
        sampler = rank_sampler(self.trainer, len(dataset), consumed_samples, self.micro_batch_size)
        options = {
            "batch_sampler": sampler,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory and torch.cuda.is_available(),
            "persistent_workers": self.persistent_workers,
            "collate_fn": collate_training_batch,
        }
        if train:
            return ResumableDataLoader(
                dataset,
                consumed_samples=self.consumed_samples,
                micro_batches_per_fetch=self.micro_batches_per_fetch,
                **options,
            )
        return DataLoader(dataset, **options)

    def train_dataloader(self) -> DataLoader:
        self.init_global_step = self.trainer.global_step
        if not self.init_consumed_samples:
            self.init_consumed_samples = self.trainer.global_step * self.global_batch_size
        return self._loader(self.datasets[Split.train], train=True)

    def val_dataloader(self) -> DataLoader | list:
        return self._loader(self.datasets.get(Split.valid), train=False)

    def test_dataloader(self) -> DataLoader | list:
        return self._loader(self.datasets.get(Split.test), train=False)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.init_consumed_samples = int(state_dict["consumed_samples"])

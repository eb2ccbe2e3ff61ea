"""`SampledDataModule`: what every data module shares, Megatron's batch bookkeeping.

- the global batch: `global_batch_size=None` is one micro-batch per data-parallel rank (`micro_batch_size` x the
  data-parallel size, which tensor, pipeline and context parallel ranks do not multiply), and the trainer
  accumulates `global_batch_size / (micro_batch_size x data-parallel size)` micro-batches per optimizer step;
- the consumed samples: stored in every checkpoint (`state_dict`), where the training sampler of a resumed run
  starts, and what the console shows; after a change of global batch on resume they go on from the stored
  count, `consumed_samples + (step - resumed step) x global_batch_size`;
- the loaders: training over Megatron's pretraining sampler (`ResumableDataLoader`), evaluation from sample 0.
"""

import logging
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.data.sampler import ResumableDataLoader, data_parallel_rank_and_size, rank_sampler

log = logging.getLogger(__name__)


class SampledDataModule(pl.LightningDataModule):
    """Base of the data modules: global batch, gradient accumulation, consumed samples and loaders.

    Subclasses call `super().setup(stage)` first in `setup`, build their training set in `train_dataloader` with
    `self.train_samples()` samples (known only once a resumed run's state is loaded) and hand it to
    `self.train_loader`; `vocab_size` is the number of token ids their data may hold.
    """

    def __init__(self, micro_batch_size: int, global_batch_size: int | None, num_workers: int) -> None:
        super().__init__()
        name = type(self).__name__
        if micro_batch_size < 1:
            raise ValueError(f"{name}(micro_batch_size={micro_batch_size}): use 1 or more")
        if global_batch_size is not None and global_batch_size < micro_batch_size:
            raise ValueError(
                f"{name}: global_batch_size={global_batch_size} is below micro_batch_size={micro_batch_size}; use "
                "a multiple of micro_batch_size x data-parallel size, or None (one micro-batch per data-parallel rank)"
            )
        if num_workers < 0:
            raise ValueError(f"{name}(num_workers={num_workers}): use 0 (load in the training process) or more")
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.num_workers = num_workers
        self.init_consumed_samples: int | None = None  # at `init_global_step`: from a checkpoint, or the loader
        self.init_global_step: int | None = None

    @property
    def vocab_size(self) -> int:
        """How many token ids the data may hold (its tokenizer's vocabulary): the model's vocabulary must cover them."""
        raise NotImplementedError(f"{type(self).__name__} does not say how many token ids its data holds")

    @property
    def vocab_source(self) -> str:
        """Where `vocab_size` comes from, for messages."""
        return f"{type(self).__name__}'s tokenizer"

    def setup(self, stage: str = "") -> None:
        """Resolve the global batch over the data-parallel ranks and set the trainer's gradient accumulation."""
        _, data_parallel_size = data_parallel_rank_and_size(self.trainer)
        per_step = self.micro_batch_size * data_parallel_size
        if self.global_batch_size is None:
            self.global_batch_size = per_step
        if self.global_batch_size % per_step:
            raise ValueError(
                f"{type(self).__name__}: global_batch_size={self.global_batch_size} must be a multiple of "
                f"micro_batch_size * data-parallel size = {self.micro_batch_size} * {data_parallel_size}"
            )
        self.trainer.accumulate_grad_batches = self.global_batch_size // per_step

    def without_validation(self, reason: str) -> None:
        """Turn the trainer's validation off (`limit_val_batches=0`) for data that has none, instead of handing
        Lightning an empty loader at every validation interval."""
        if self.trainer.limit_val_batches != 0:
            log.info("%s: %s; validation is off", type(self).__name__, reason)
            self.trainer.limit_val_batches = 0

    def consumed_samples(self) -> int:
        """Training samples consumed so far, over all data-parallel ranks."""
        step = self.trainer.global_step
        if self.init_consumed_samples is None:
            return step * self.global_batch_size
        start = step if self.init_global_step is None else self.init_global_step
        return self.init_consumed_samples + (step - start) * self.global_batch_size

    def train_samples(self) -> int:
        """Samples the training set needs: those consumed, then a global batch for each step left to `max_steps`."""
        steps_left = max(1, self.trainer.max_steps - self.trainer.global_step)
        return self.consumed_samples() + steps_left * self.global_batch_size

    def train_loader(self, dataset: Dataset, **options: Any) -> ResumableDataLoader:
        """This rank's training loader over `dataset`, starting after the consumed samples."""
        self.init_consumed_samples, self.init_global_step = self.consumed_samples(), self.trainer.global_step
        sampler = rank_sampler(self.trainer, len(dataset), self.init_consumed_samples, self.micro_batch_size)
        return ResumableDataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            consumed_samples=self.consumed_samples,
            **options,
        )

    def eval_loader(self, dataset: Dataset, **options: Any) -> DataLoader:
        """This rank's validation or test loader over `dataset`, always from sample 0."""
        sampler = rank_sampler(self.trainer, len(dataset), 0, self.micro_batch_size)
        return DataLoader(dataset, batch_sampler=sampler, num_workers=self.num_workers, **options)

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples(), "global_step": self.trainer.global_step}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.init_consumed_samples = int(state_dict["consumed_samples"])
        step = state_dict.get("global_step")  # absent in checkpoints of 0.1: then the step the run resumes at
        self.init_global_step = None if step is None else int(step)

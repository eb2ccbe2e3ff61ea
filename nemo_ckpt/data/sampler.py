"""Megatron's pretraining sampler, the resumable DataLoader over it and the data-parallel coordinates it shards by
(shared by the data modules)."""

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Sampler

from nemo_ckpt.parallel.mesh import parallel_dims_of


class PretrainingSampler(Sampler[list[int]]):
    """Megatron's pretraining sampler: this rank's micro-batches, starting after `consumed_samples`."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    def _starts(self) -> range:
        stride = self.micro_batch_size * self.data_parallel_size
        last = self.total_samples - stride + 1
        return range(self.consumed_samples, max(last, self.consumed_samples), stride)

    def __len__(self) -> int:
        """Micro-batches of the whole pass, consumed ones included (as Megatron's sampler): a resumed Lightning
        epoch counts its batches from the epoch's start, so it ends where the uninterrupted one does."""
        return self.total_samples // (self.micro_batch_size * self.data_parallel_size)

    def __iter__(self) -> Iterator[list[int]]:
        offset = self.data_parallel_rank * self.micro_batch_size
        for start in self._starts():
            yield list(range(start + offset, start + offset + self.micro_batch_size))


class FetchGroups(Sampler[list[int]]):
    """`micro_batches` consecutive micro-batches of a `PretrainingSampler` as one index list: what one worker
    fetches and collates at a time."""

    def __init__(self, sampler: PretrainingSampler, micro_batches: int) -> None:
        self.sampler, self.micro_batches = sampler, micro_batches

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.micro_batches)

    def __iter__(self) -> Iterator[list[int]]:
        group: list[int] = []
        for index, micro_batch in enumerate(self.sampler, 1):
            group += micro_batch
            if index % self.micro_batches == 0:
                yield group
                group = []
        if group:
            yield group


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `PretrainingSampler` whose state is the samples consumed before it (Lightning's
    `_Stateful`): `load_state_dict` moves the sampler there before iteration starts.

    `micro_batches_per_fetch` > 1: each worker fetch collates that many consecutive micro-batches into one batch,
    which the training process splits back into micro-batches (views). A worker hands every batch over through
    shared memory at a fixed cost per tensor, so this divides that cost; samples and their order are unchanged.
    """

    def __init__(
        self,
        *args: Any,
        consumed_samples: Callable[[], int],
        batch_sampler: PretrainingSampler,
        micro_batches_per_fetch: int = 1,
        **kwargs: Any,
    ) -> None:
        if micro_batches_per_fetch < 1:
            raise ValueError(f"micro_batches_per_fetch={micro_batches_per_fetch}: use 1 or more")
        self.sampler_of_micro_batches = batch_sampler
        self.micro_batches_per_fetch = micro_batches_per_fetch
        grouped = batch_sampler if micro_batches_per_fetch == 1 else FetchGroups(batch_sampler, micro_batches_per_fetch)
        super().__init__(*args, batch_sampler=grouped, **kwargs)
        self._consumed_samples = consumed_samples

    def __len__(self) -> int:
        return len(self.sampler_of_micro_batches)

    def __iter__(self) -> Iterator[Any]:
        if self.micro_batches_per_fetch == 1:
            yield from super().__iter__()
            return
        size = self.sampler_of_micro_batches.micro_batch_size
        for batch in super().__iter__():
            rows = len(next(iter(batch.values())))
            for start in range(0, rows, size):
                yield {key: value[start : start + size] for key, value in batch.items()}

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self._consumed_samples()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.sampler_of_micro_batches.consumed_samples = int(state_dict["consumed_samples"])


def data_parallel_rank_and_size(trainer: pl.Trainer) -> tuple[int, int]:
    """This process's data-parallel rank and the data-parallel size (tensor-, context- and pipeline-parallel ranks
    share their data)."""
    dims = parallel_dims_of(trainer)
    return dims.dp_rank, dims.dp


def rank_sampler(
    trainer: pl.Trainer, dataset_size: int, consumed_samples: int, micro_batch_size: int
) -> PretrainingSampler:
    """This rank's pretraining sampler over `dataset_size` samples, sharded by data-parallel rank, starting after
    `consumed_samples`."""
    return PretrainingSampler(dataset_size, consumed_samples, micro_batch_size, *data_parallel_rank_and_size(trainer))

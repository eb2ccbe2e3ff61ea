"""`MockDataModule`: synthetic token sequences, like NeMo's `llm.MockDataModule`, resumable by step."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.data.sampler import ResumableDataLoader, rank_sampler, set_gradient_accumulation


class ArithmeticSequences(Dataset):
    """Sample i is `(start + stride * t) % vocab_size`, with start and stride drawn from a seed and i.

    Deterministic per index, so any rank can produce any sample, and learnable, so the loss falls.
    """

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(self.vocab_size, (), generator=generator)
        stride = torch.randint(1, 5, (), generator=generator)
        sequence = (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        return {"tokens": sequence[:-1], "labels": sequence[1:]}


class MockDataModule(pl.LightningDataModule):
    """Synthetic pretraining data. A resumed run continues at sample `global_step * global_batch_size`."""

    def __init__(
        self,
        seq_length: int = 32,
        vocab_size: int = 256,
        micro_batch_size: int = 4,
        global_batch_size: int = 8,
        num_train_samples: int | None = None,
        num_val_samples: int = 64,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.num_train_samples = num_train_samples
        self.num_val_samples = num_val_samples
        self.seed = seed
        self.num_workers = num_workers

    def setup(self, stage: str = "") -> None:
        set_gradient_accumulation(self.trainer, self.micro_batch_size, self.global_batch_size, "MockDataModule")
        num_train = self.num_train_samples or max(1, self.trainer.max_steps) * self.global_batch_size
        self.train_set = ArithmeticSequences(num_train, self.seq_length, self.vocab_size, self.seed)
        self.val_set = ArithmeticSequences(self.num_val_samples, self.seq_length, self.vocab_size, self.seed + 1)

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

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, 0)

"""`MockDataModule`: synthetic token sequences, like NeMo's `llm.MockDataModule`, resumable by step."""

import torch
from torch.utils.data import DataLoader, Dataset

from nemo_ckpt.data.base import SampledDataModule


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


class MockDataModule(SampledDataModule):
    """Synthetic pretraining data of `vocab_size` token ids. A resumed run continues after the consumed samples.

    `global_batch_size=None`: one micro-batch per data-parallel rank (see `SampledDataModule`).
    """

    def __init__(
        self,
        seq_length: int = 32,
        vocab_size: int = 256,
        micro_batch_size: int = 4,
        global_batch_size: int | None = 8,
        num_train_samples: int | None = None,
        num_val_samples: int = 64,
        seed: int = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__(micro_batch_size, global_batch_size, num_workers)
        self.seq_length = seq_length
        self._vocab_size = vocab_size
        self.num_train_samples = num_train_samples
        self.num_val_samples = num_val_samples
        self.seed = seed

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab_source(self) -> str:
        return f"MockDataModule(vocab_size={self._vocab_size})"

    def setup(self, stage: str = "") -> None:
        super().setup(stage)
        self.val_set = ArithmeticSequences(self.num_val_samples, self.seq_length, self.vocab_size, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        num_train = self.num_train_samples or self.train_samples()
        return self.train_loader(ArithmeticSequences(num_train, self.seq_length, self.vocab_size, self.seed))

    def val_dataloader(self) -> DataLoader:
        return self.eval_loader(self.val_set)

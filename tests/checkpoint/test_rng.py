"""Random generators continue after a resume as in an uninterrupted run, on every rank."""

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.recipe import train


class Draws(pl.Callback):
    """Draw from the Python, NumPy and torch generators inside every training step (as dropout would), rank r
    `r + 1` times, so the ranks' generators drift apart."""

    def __init__(self) -> None:
        self.draws: dict[int, tuple[float, ...]] = {}

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        for _ in range(trainer.global_rank + 1):
            draws = (random.random(), float(np.random.rand()), torch.rand(()).item())
        self.draws[trainer.global_step + 1] = draws


class StopAfter(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.should_stop = trainer.global_step >= self.step


def draw_then_resume(rank: int, world_size: int, root: str) -> tuple[dict, dict]:
    uninterrupted, before, after = Draws(), Draws(), Draws()
    train(Path(root) / "uninterrupted", 6, world_size, callbacks=[uninterrupted], every_n_train_steps=3)
    train(Path(root) / "resumed", 6, world_size, callbacks=[before, StopAfter(3)], every_n_train_steps=3)
    train(Path(root) / "resumed", 6, world_size, callbacks=[after], every_n_train_steps=3)
    assert sorted(before.draws) == [1, 2, 3] and sorted(after.draws) == [4, 5, 6]
    return uninterrupted.draws, after.draws


@pytest.fixture(scope="module")
def draws(tmp_path_factory) -> list[tuple[dict, dict]]:
    return run_distributed(draw_then_resume, 2, str(tmp_path_factory.mktemp("rng")))


def test_resumed_run_draws_what_the_uninterrupted_run_drew(draws):
    for uninterrupted, resumed in draws:
        assert resumed == {step: uninterrupted[step] for step in (4, 5, 6)}
        assert resumed[4] != uninterrupted[1], "a freshly seeded run would repeat step 1's draws"


def test_each_rank_gets_its_own_generator_state_back(draws):
    (rank0, _), (rank1, _) = draws
    assert all(rank0[step] != rank1[step] for step in rank0)

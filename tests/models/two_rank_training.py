"""A `run_distributed` body that trains the tiny GPT for one step on its ranks under several strategies and saves
a checkpoint after each (kept out of the test modules so that spawned ranks do not import `transformers`)."""

from pathlib import Path

from tests.helpers.trainer import fit


def train_and_save(rank: int, world_size: int, runs: dict[str, dict], directory: Path) -> None:
    """For each `name: strategy options` of `runs`, one training step saved to `directory / name`."""
    for name, strategy_kwargs in runs.items():
        kwargs = dict(strategy_kwargs)
        fit(world_size, kwargs.pop("ddp"), max_steps=1, save_to=directory / name, **kwargs)

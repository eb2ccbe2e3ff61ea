"""Train the tiny GPT with `MegatronStrategy` inside a `run_distributed` rank (a plain Trainer, no recipe)."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.data import MockDataModule
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.optim import OptimizerConfig
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.strategy import MegatronStrategy

GLOBAL_BATCH_SIZE = 4


def build_trainer(strategy: pl.strategies.Strategy | str = "auto", **trainer_kwargs: Any) -> pl.Trainer:
    """A Trainer on one CPU device without logger, checkpointing, progress bar, model summary or validation, the
    data module's own sampler kept (our data modules shard by data-parallel rank); `trainer_kwargs` override."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(strategy=strategy, **(settings | trainer_kwargs))


class RecordLoss(pl.Callback):
    """The data-parallel mean loss of every step (not of each gradient-accumulation micro-batch)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.step = 0

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.step:
            self.step = trainer.global_step
            self.losses.append(float(trainer.callback_metrics["reduced_train_loss"]))


class SaveAtStart(pl.Callback):
    """Save a checkpoint to `path` before the first step (after any resume), to see what was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class StopAndSave(pl.Callback):
    """Stop after step `stop_at` (None: at `max_steps`) and save a checkpoint to `path`."""

    def __init__(self, stop_at: int | None, path: Path | None) -> None:
        self.stop_at = stop_at
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.path is not None:
            trainer.save_checkpoint(self.path)


def fit_tiny_gpt(
    world_size: int,
    strategy: MegatronStrategy,
    max_steps: int,
    callbacks: list[pl.Callback],
    ckpt_path: Path | None = None,
    precision: str = "32-true",
    model_overrides: dict[str, Any] | None = None,
    micro_batch_size: int | None = None,
    accelerator: str = "cpu",
) -> pl.Trainer:
    """Train the tiny GPT with `strategy` (global batch 4, one micro-batch per data-parallel rank unless
    `micro_batch_size` is given) towards `max_steps` on a plain Trainer, resuming from `ckpt_path`."""
    pl.seed_everything(1234, verbose=False)
    config = gpt_config("tiny", **(model_overrides or {}))
    trainer = build_trainer(
        strategy,
        accelerator=accelerator,
        devices=world_size,
        max_steps=max_steps,
        precision=precision,
        callbacks=callbacks,
    )
    model = GPTModel(config, OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_steps=2))
    parallelism = strategy.parallelism
    model_parallel_size = parallelism.tensor_model_parallel_size * parallelism.pipeline_model_parallel_size
    model_parallel_size *= parallelism.context_parallel_size  # cp ranks read the same batch
    data_parallel_size = world_size // model_parallel_size
    data = MockDataModule(
        seq_length=config.seq_length,
        vocab_size=config.vocab_size,
        micro_batch_size=micro_batch_size or GLOBAL_BATCH_SIZE // data_parallel_size,
        global_batch_size=GLOBAL_BATCH_SIZE,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def fit(
    world_size: int,
    ddp: dict[str, Any],
    max_steps: int,
    *,
    precision: str = "32-true",
    ckpt_path: Path | None = None,
    stop_at: int | None = None,
    save_to: Path | None = None,
    save_at_start: Path | None = None,
    model_overrides: dict[str, Any] | None = None,
    callbacks: list[pl.Callback] | None = None,
    micro_batch_size: int | None = None,
    accelerator: str = "cpu",
    **strategy_kwargs: Any,
) -> list[float]:
    """Train towards `max_steps` (global batch 4, split over the ranks), resuming from `ckpt_path`, stopping
    after step `stop_at`; save the loaded state to `save_at_start` and the final one to `save_to`.
    Return the per-step losses."""
    strategy = MegatronStrategy(ddp=DistributedDataParallelConfig(**ddp), **strategy_kwargs)
    recorder = RecordLoss()
    callbacks = [recorder, StopAndSave(stop_at, save_to), *(callbacks or [])]
    if save_at_start is not None:
        callbacks.append(SaveAtStart(save_at_start))
    fit_tiny_gpt(
        world_size, strategy, max_steps, callbacks, ckpt_path, precision, model_overrides, micro_batch_size, accelerator
    )
    return recorder.losses


def assert_same_checkpoint(saved: Path, loaded: Path) -> None:
    """Every tensor, the step and the optimizer's param groups of two checkpoints are identical."""
    expected = dist_checkpointing.load_plain_tensors(saved / "weights")
    actual = dist_checkpointing.load_plain_tensors(loaded / "weights")
    assert expected.keys() == actual.keys()
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in expected)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    expected_common = dist_checkpointing.load_common_state_dict(saved / "weights")
    actual_common = dist_checkpointing.load_common_state_dict(loaded / "weights")
    assert actual_common["global_step"] == expected_common["global_step"]
    [expected_optim], [actual_optim] = expected_common["optimizer_states"], actual_common["optimizer_states"]
    assert expected_optim["state"].keys() == actual_optim["state"].keys()
    for name, state in expected_optim["state"].items():
        assert torch.equal(state["step"], actual_optim["state"][name]["step"]), name
    assert actual_optim["param_groups"] == expected_optim["param_groups"]

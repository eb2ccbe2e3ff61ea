"""Megatron's batch bookkeeping in the recipes: the global batch defaults to micro batch x data-parallel size (tensor
parallel ranks do not multiply it), and after a change of global batch on resume the consumed samples the console
shows, the checkpoint stores and the sampler starts after agree."""

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.checkpoint.manifest import Manifest
from nemo_ckpt.data.mock import ArithmeticSequences
from nemo_ckpt.logger.runs import version_dirs
from nemo_ckpt.logger.text_log import text_log_name
from tests.helpers.distributed import run_distributed
from tests.helpers.recipe import RUN_NAME, checkpoint_dir, train


class RecordBatches(pl.Callback):
    """The global batch, accumulation and consumed samples a run starts with, and its first micro-batch."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        data = trainer.datamodule
        self.seen.update(
            global_batch_size=data.global_batch_size,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            consumed_samples=data.consumed_samples(),
        )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self.seen.setdefault("first_tokens", batch["tokens"].clone())


def train_recording(root: Path, max_steps: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    recorder = RecordBatches()
    train(root, max_steps, world_size, callbacks=[recorder], **kwargs)
    return recorder.seen


def run_scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    root = Path(root)
    tensor_parallel = {"trainer.strategy.tensor_model_parallel_size": 2}
    results = {"tp": train_recording(root / "tp", 1, world_size, overrides=tensor_parallel)}
    results["first"] = train_recording(root / "gbs", 4, world_size, every_n_train_steps=2)
    smaller = {"data.global_batch_size": 4, "data.micro_batch_size": 2}
    results["resumed"] = train_recording(root / "gbs", 6, world_size, every_n_train_steps=2, overrides=smaller)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("batches")
    return root, run_distributed(run_scenarios, 2, str(root))


def test_global_batch_defaults_to_one_micro_batch_per_data_parallel_rank(runs):
    _, results = runs
    for result in results:
        assert result["first"]["global_batch_size"] == 8 and result["first"]["accumulate_grad_batches"] == 1
        # TP=2 on 2 processes: one data-parallel rank, so one micro-batch of 4 per step, not 2 x 4 accumulated
        assert result["tp"]["global_batch_size"] == 4 and result["tp"]["accumulate_grad_batches"] == 1


def test_consumed_samples_agree_after_a_change_of_global_batch(runs):
    root, results = runs
    directory = checkpoint_dir(root / "gbs")
    [final] = [record for record in Manifest.read(directory).checkpoints if record.step == 6]
    common = dist_checkpointing.load_common_state_dict(weights_dir(directory / final.name))
    assert common["MockDataModule"]["consumed_samples"] == 4 * 8 + 2 * 4 == 40
    log = (version_dirs(root / "gbs" / RUN_NAME)[-1] / text_log_name(0, 0)).read_text()
    assert "resuming from" in log and "at step 4, consumed_samples 32" in log
    assert "iteration 6/6 | consumed_samples 40 |" in log
    samples = ArithmeticSequences(64, 32, 256, seed=1234)  # the recipe's mock data: sample i is a function of i
    for rank, result in enumerate(results):
        assert result["resumed"]["consumed_samples"] == 32 and result["resumed"]["global_batch_size"] == 4
        expected = torch.stack([samples[32 + rank * 2 + i]["tokens"] for i in range(2)])
        assert torch.equal(result["resumed"]["first_tokens"], expected)  # the sampler starts after sample 32

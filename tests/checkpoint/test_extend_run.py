"""A finished run re-run with a larger `max_steps` resumes from its last checkpoint and trains on; one whose last
checkpoints hold no optimizer state is refused before training, with the fix, and `ckpt_load_optimizer=False`
resumes its weights with a fresh optimizer."""

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.layout import weights_dir
from nemo_ckpt.checkpoint.manifest import Manifest
from nemo_ckpt.checkpoint.resume import AutoResume
from nemo_ckpt.optim import OptimizerConfig
from tests.helpers.distributed import run_distributed
from tests.helpers.recipe import checkpoint_dir, train

ONLY_AT_THE_END = {"every_n_train_steps": 10}  # no save is due before step 10: a 4-step run saves at its end only
RECIPE_OPTIM = OptimizerConfig(lr=3e-3, min_lr=3e-4, lr_warmup_steps=2)  # the tiny recipe's


class RecordStart(pl.Callback):
    """What a run starts with: its step, whether its optimizer holds state, the lr of its first step, its weights."""

    def __init__(self) -> None:
        self.start: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        self.start = {
            "step": trainer.global_step,
            "optimizer_state": sum(len(state) for state in optimizer.state.values()),
            "lr": optimizer.param_groups[0]["lr"],
            "weights": {key: value.detach().clone() for key, value in pl_module.state_dict().items()},
        }


def train_recording(root: Path, max_steps: int, world_size: int, **kwargs: Any) -> dict[str, Any]:
    recorder = RecordStart()
    train(root, max_steps, world_size, callbacks=[recorder], **kwargs)
    return recorder.start


def run_scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    root = Path(root)
    results: dict[str, Any] = {}
    train(root / "extend", 4, world_size, **ONLY_AT_THE_END)
    results["extend"] = train_recording(root / "extend", 7, world_size, **ONLY_AT_THE_END)

    train(root / "weights", 4, world_size, **ONLY_AT_THE_END, save_optim_on_train_end=False)
    try:
        train(root / "weights", 7, world_size, **ONLY_AT_THE_END)
    except FileExistsError as error:
        results["weights_refused"] = str(error)
    results["weights"] = train_recording(
        root / "weights", 7, world_size, **ONLY_AT_THE_END, overrides={"trainer.strategy.ckpt_load_optimizer": False}
    )
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("extend")
    return root, run_distributed(run_scenarios, 2, str(root))


def steps(directory: Path) -> list[tuple[int, bool]]:
    return [(record.step, record.weights_only) for record in Manifest.read(directory).checkpoints]


def checkpoint_weights(directory: Path, step: int) -> dict[str, torch.Tensor]:
    [record] = [record for record in Manifest.read(directory).checkpoints if record.step == step]
    tensors = dist_checkpointing.load_plain_tensors(weights_dir(directory / record.name))
    return {key: value for key, value in tensors.items() if not key.startswith("optimizer.")}


def test_extended_run_resumes_its_last_checkpoint_and_trains_on(runs):
    root, results = runs
    directory = checkpoint_dir(root / "extend")
    assert steps(directory) == [(4, False), (7, False)]  # the end-of-training checkpoint holds optimizer state
    for result in results:
        start = result["extend"]
        assert start["step"] == 4 and start["optimizer_state"] > 0
        saved = checkpoint_weights(directory, 4)
        assert all(torch.equal(value, saved[key]) for key, value in start["weights"].items())
        assert start["lr"] == pytest.approx(3e-3 * RECIPE_OPTIM.lr_factor(4, 7))  # the new schedule, not step 4 of 4


def test_weights_only_checkpoints_are_refused_with_the_fix_and_resume_without_optimizer(runs):
    root, results = runs
    directory = checkpoint_dir(root / "weights")
    for result in results:
        refused = result["weights_refused"]
        assert "holds 1 checkpoints without optimizer state" in refused
        assert "set trainer.strategy.ckpt_load_optimizer=False" in refused
        assert "set resume.resume_if_exists" not in refused  # never asks for a setting the run already has
        start = result["weights"]
        assert start["step"] == 4 and start["optimizer_state"] == 0  # its weights, at its step, a fresh optimizer
        saved = checkpoint_weights(directory, 4)
        assert all(torch.equal(value, saved[key]) for key, value in start["weights"].items())
        assert start["lr"] == pytest.approx(3e-3 * RECIPE_OPTIM.lr_factor(4, 7))
    assert steps(directory) == [(4, True), (7, False)]


def test_weights_only_checkpoints_are_skipped_at_warning(runs, caplog):
    root, _ = runs
    directory = checkpoint_dir(root / "weights")
    assert AutoResume(resume_if_exists=True).find_checkpoint(directory).name.endswith("step=7")
    end_only = checkpoint_dir(root / "weights_copy")
    _copy_weights_only(directory, end_only)
    with caplog.at_level("WARNING"), pytest.raises(FileExistsError, match="ckpt_load_optimizer=False"):
        AutoResume(resume_if_exists=True, resume_ignore_no_checkpoint=True).find_checkpoint(
            end_only, writes_checkpoints=True
        )
    assert "holds no optimizer state" in caplog.text and "save_optim_on_train_end=False" in caplog.text
    assert AutoResume(resume_if_exists=True).find_checkpoint(end_only, load_optimizer=False).name.endswith("step=4")


def _copy_weights_only(source: Path, target: Path) -> None:
    """`target` holds `source`'s weights-only checkpoint alone (a copy of its directory and manifest record)."""
    target.mkdir(parents=True)
    manifest = Manifest.read(source)
    [record] = [record for record in manifest.checkpoints if record.weights_only]
    shutil.copytree(source / record.name, target / record.name)
    copy = Manifest()
    copy.add(record)
    copy.write(target)

"""`ModelCheckpoint` on real 2-rank training through `pretrain`: what is written when, what is kept, what it costs
on disk, what a checkpoint alone rebuilds. The runs happen once, in two spawned ranks; the tests read the disk."""

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint import context
from nemo_ckpt.checkpoint.layout import LAST_SUFFIX, weights_dir
from nemo_ckpt.checkpoint.manifest import Manifest
from nemo_ckpt.checkpoint.resume import AutoResume
from tests.helpers.distributed import run_distributed
from tests.helpers.recipe import checkpoint_dir, train

NO_WARMUP = {"optim.lr_warmup_steps": 0}  # the logged lr then falls every step: with mode="min" the newest is best


def run_scenarios(rank: int, world_size: int, root: str) -> dict[str, str]:
    root = Path(root)
    every_step = {"every_n_train_steps": 1, "overrides": NO_WARMUP}
    train(root / "last_is_best", 4, world_size, monitor="lr", mode="min", save_top_k=1, **every_step)
    train(root / "last_is_not_best", 4, world_size, monitor="lr", mode="max", save_top_k=1, **every_step)
    train(root / "top_k", 6, world_size, monitor="reduced_train_loss", save_top_k=2, every_n_train_steps=1)
    train(root / "best", 4, world_size, monitor="lr", mode="max", save_top_k=0, save_best_model=True, **every_step)
    train(root / "async", 4, world_size, monitor="lr", mode="min", save_top_k=1, async_save=True, **every_step)
    train(root / "time_short", 3, world_size, train_time_interval=timedelta(microseconds=1))
    train(root / "time_long", 3, world_size, train_time_interval=timedelta(hours=1))
    train(
        root / "epochs",
        6,
        world_size,
        save_on_train_epoch_end=True,
        overrides={"trainer.limit_train_batches": 3, "trainer.val_check_interval": None},
    )
    train(root / "end", 5, world_size, every_n_train_steps=2, save_optim_on_train_end=False)
    train(root / "end_optim", 5, world_size, every_n_train_steps=2)  # the default: the last checkpoint resumes
    train(root / "config", 2, world_size, every_n_train_steps=2, overrides={"model.config.num_layers": 1})
    train(
        root / "config", 4, world_size, every_n_train_steps=2, resume={"resume_if_exists": True, "restore_config": True}
    )
    errors = {}
    try:
        train(root / "top_k", 8, world_size, every_n_train_steps=1, resume={"resume_if_exists": False})
    except FileExistsError as error:  # refused before training starts (AutoResume)
        errors["fresh_run_in_used_dir"] = str(error)
    return errors


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("runs")
    return root, run_distributed(run_scenarios, 2, str(root))


def records(root: Path, run: str) -> list[tuple[int, bool]]:
    """(step, weights_only) of every checkpoint, oldest first; all complete, all on disk and linked right."""
    directory = checkpoint_dir(root / run)
    manifest = Manifest.read(directory)
    assert all(record.state == "complete" for record in manifest.checkpoints)
    on_disk = sorted(p.name for p in directory.iterdir() if p.is_dir() and not p.is_symlink())
    assert on_disk == sorted(record.name for record in manifest.checkpoints)
    assert [p.name for p in directory.iterdir() if p.is_symlink()] == [f"{manifest.last}{LAST_SUFFIX}"]
    assert manifest.last == manifest.checkpoints[-1].name
    return [(record.step, record.weights_only) for record in manifest.checkpoints]


def steps(root: Path, run: str) -> list[int]:
    return [step for step, _ in records(root, run)]


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path`, links counted as links (as `du` does)."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def test_last_that_is_also_top_k_is_written_once(runs):
    root, _ = runs
    assert steps(root, "last_is_best") == [4]
    assert steps(root, "last_is_not_best") == [1, 4]
    one = checkpoint_dir(root / "last_is_best")
    checkpoint = one / Manifest.read(one).last
    assert (one / f"{checkpoint.name}{LAST_SUFFIX}").resolve() == checkpoint.resolve()
    size = disk_bytes(checkpoint)
    assert disk_bytes(one) < size * 1.02, "-last and top-1 are the same step: one copy"
    assert disk_bytes(checkpoint_dir(root / "last_is_not_best")) > size * 1.9, "two different steps: two copies"


def test_top_k_by_monitored_metric_with_true_steps_in_names(runs):
    root, _ = runs
    directory = checkpoint_dir(root / "top_k")
    manifest = Manifest.read(directory)
    by_loss = sorted(manifest.checkpoints, key=lambda r: r.metrics["reduced_train_loss"])
    newest = manifest.checkpoints[-1]
    assert newest.step == 6
    assert {r.name for r in manifest.checkpoints} == {r.name for r in by_loss[:2]} | {newest.name}
    for record in manifest.checkpoints:
        assert record.name.endswith(f"-step={record.step}")
        assert f"reduced_train_loss={record.metrics['reduced_train_loss']:.4f}" in record.name
        common = dist_checkpointing.load_common_state_dict(weights_dir(directory / record.name))
        assert common["global_step"] == record.step


def test_best_is_kept_whatever_save_top_k(runs):
    root, _ = runs
    assert steps(root, "best") == [1, 4], "the best (highest lr: step 1) and -last"


def test_async_saves_commit_in_order_and_delete_only_committed(runs):
    root, _ = runs
    assert records(root, "async") == [(4, False)]


def test_train_time_interval(runs):
    root, _ = runs
    assert records(root, "time_short") == [(1, False), (2, False), (3, False)]
    assert records(root, "time_long") == [(3, False)], "only the end of training (with optimizer state: it resumes)"


def test_save_on_train_epoch_end(runs):
    root, _ = runs
    assert records(root, "epochs") == [(3, False), (6, False)]


def test_end_of_training_checkpoint_holds_optimizer_state_unless_asked_not_to(runs):
    root, _ = runs
    assert records(root, "end") == [(2, False), (4, False), (5, True)]
    assert records(root, "end_optim") == [(2, False), (4, False), (5, False)]
    end, end_optim = checkpoint_dir(root / "end"), checkpoint_dir(root / "end_optim")
    without = dist_checkpointing.load_plain_tensors(weights_dir(end / Manifest.read(end).last))
    with_optim = dist_checkpointing.load_plain_tensors(weights_dir(end_optim / Manifest.read(end_optim).last))
    assert not any(key.startswith("optimizer.") for key in without)
    assert any(key.startswith("optimizer.") for key in with_optim)
    assert AutoResume(resume_if_exists=True).find_checkpoint(end).name.endswith("step=4")
    assert AutoResume(resume_if_exists=True).find_checkpoint(end_optim).name.endswith("step=5")


def test_checkpoint_alone_rebuilds_its_model_and_restore_config_uses_it(runs):
    root, _ = runs
    directory = checkpoint_dir(root / "config")
    assert steps(root, "config") == [2, 4]
    checkpoint = directory / Manifest.read(directory).last
    config = context.load_context(checkpoint, "model")
    assert config.config.num_layers == 1, "the resumed run kept the checkpoint's model, not the recipe's 2 layers"
    assert config.optim.lr == 3e-3, "the optimizer `pretrain` was given is recorded"
    model = context.load_model(checkpoint)
    saved = dist_checkpointing.load_plain_tensors(weights_dir(checkpoint))
    assert model.config.num_layers == 1 and model.state_dict().keys() <= saved.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_fresh_run_into_a_used_directory_fails_and_keeps_its_checkpoints(runs):
    root, errors = runs
    for rank_errors in errors:
        assert "holds 3 checkpoints of an earlier run" in rank_errors["fresh_run_in_used_dir"]
    assert steps(root, "top_k")[-1] == 6

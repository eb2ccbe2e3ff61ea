"""A save that cannot be written (disk full, directory made read-only mid-run, directory not writable from the
start) fails with one clear error on every rank, before writing anything, and leaves the earlier checkpoints
intact and resumable."""

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.layout import TMP_PREFIX, is_complete, weights_dir
from nemo_ckpt.checkpoint.manifest import Manifest
from tests.helpers.distributed import run_distributed
from tests.helpers.recipe import train

CHECKPOINT_MB = 1.7  # one tiny-recipe checkpoint (1,775,393 bytes)


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def make_unwritable(path: Path) -> None:
    """Read-only for this user: for root (who ignores permissions) a read-only bind mount over `path` (a plain
    read-only remount is refused while the run holds its writer lock open), else `chmod 555`."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
    else:
        path.chmod(0o555)


class UnwritableAfter(pl.Callback):
    """Make `path` unwritable once `step` is done, before that step's checkpoint is saved."""

    def __init__(self, path: str, step: int) -> None:
        self.path = Path(path)
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            make_unwritable(self.path)


def attempt(**kwargs: Any) -> str | None:
    try:
        train(**kwargs)
    except RuntimeError as error:
        return str(error)
    return None


def failing_saves(rank: int, world_size: int, root: str, full: str | None, read_only: str | None) -> dict:
    root = Path(root)
    errors = {}
    common = {"max_steps": 4, "world_size": world_size, "every_n_train_steps": 1, "save_top_k": -1}
    if full:
        errors["full"] = attempt(directory=root / "full", dirpath=full, **common)
        if rank == 0:
            subprocess.run(["mount", "-o", "remount,size=64m", full], check=True)
        errors["full_resumed"] = attempt(directory=root / "full", dirpath=full, **common)
    if read_only:
        errors["read_only"] = attempt(
            directory=root / "read_only", dirpath=read_only, callbacks=[UnwritableAfter(read_only, 2)], **common
        )
    (root / "a_file").write_text("not a directory")
    errors["not_writable"] = attempt(directory=root / "not_writable", dirpath=str(root / "a_file" / "ckpt"), **common)
    return errors


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    root = tmp_path_factory.mktemp("failures")
    full = root / "full_fs"  # room for 2 checkpoints
    full = full if mount_tmpfs(full, f"{int(2.8 * CHECKPOINT_MB * 1024)}k") else None
    read_only = root / "read_only_fs"
    if os.geteuid() == 0:
        read_only = read_only if mount_tmpfs(read_only, "64m") else None
    else:
        read_only.mkdir()
    try:
        yield (
            full,
            read_only,
            run_distributed(failing_saves, 2, str(root), full and str(full), read_only and str(read_only)),
        )
    finally:
        for path in (full, read_only, read_only):  # read_only: the bind mount, then the tmpfs under it
            if path is not None and os.geteuid() == 0:
                subprocess.run(["umount", "-l", str(path)], check=False)


def intact(directory: Path) -> list[int]:
    """Steps of the complete checkpoints in `directory`, each loadable; nothing half-written left behind."""
    manifest = Manifest.read(directory)
    for record in manifest.checkpoints:
        assert record.state == "complete" and is_complete(directory / record.name)
        assert (
            dist_checkpointing.load_common_state_dict(weights_dir(directory / record.name))["global_step"]
            == record.step
        )
        assert dist_checkpointing.load_plain_tensors(weights_dir(directory / record.name))
    assert not any(p.name.startswith(TMP_PREFIX) for p in directory.iterdir())
    return [record.step for record in manifest.checkpoints]


def test_disk_full_fails_clearly_keeps_earlier_checkpoints_and_resumes(outcome):
    full, _, errors = outcome
    if full is None:
        pytest.skip("needs permission to mount a small tmpfs (root)")
    for rank_errors in errors:
        assert rank_errors["full"].startswith("ModelCheckpoint: preparing")
        assert "No space left for step 3" in rank_errors["full"]
        free_mib, needed_mib = map(
            float, re.search(r"([\d.]+) MiB free, its last checkpoint took ([\d.]+) MiB", rank_errors["full"]).groups()
        )
        assert free_mib < needed_mib and abs(needed_mib - CHECKPOINT_MB) < 0.1
        assert rank_errors["full_resumed"] is None
    assert intact(full) == [1, 2, 3, 4], "after space was freed, the run resumed from step 2 and finished"


def test_directory_made_read_only_mid_run_fails_clearly_and_keeps_earlier_checkpoints(outcome):
    _, read_only, errors = outcome
    if read_only is None:
        pytest.skip("needs permission to mount a tmpfs it can make read-only (root)")
    for rank_errors in errors:
        assert "ModelCheckpoint: preparing" in rank_errors["read_only"]
        assert "Read-only file system" in rank_errors["read_only"] or "Permission denied" in rank_errors["read_only"]
    assert intact(read_only) == [1]


def test_directory_not_writable_from_the_start_fails_before_training(outcome):
    *_, errors = outcome
    for rank_errors in errors:
        assert "ModelCheckpoint(dirpath=" in rank_errors["not_writable"]
        assert "is not writable; choose a writable dirpath" in rank_errors["not_writable"]
        assert "NotADirectoryError" in rank_errors["not_writable"]

"""What a crash leaves behind, and how `AutoResume` and `ModelCheckpoint.recover` deal with it.

The commit protocol is checked at every point a crash can hit: a forked process commits a checkpoint and is
SIGKILLed right before its k-th file-system change (k = 1, 2, ... until the commit finishes), chosen with an
audit hook, not a mock: the kill is real.
"""

import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import pytest

from nemo_ckpt.checkpoint.layout import LAST_SUFFIX, MANIFEST_NAME, TMP_PREFIX, TRASH_PREFIX, is_complete
from nemo_ckpt.checkpoint.manifest import CheckpointRecord, Manifest
from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint
from nemo_ckpt.checkpoint.resume import AutoResume, newest_resumable


def fake_checkpoint(path: Path, payload: bytes = b"weights") -> Path:
    (path / "weights").mkdir(parents=True)
    (path / "weights" / "__0_0.distcp").write_bytes(payload)
    (path / "weights" / "metadata.json").write_text("{}")
    return path


def make_directory(directory: Path, *records: CheckpointRecord, last: str | None = None) -> None:
    for record in records:
        if record.state != "saving":
            fake_checkpoint(directory / record.name, record.name.encode())
    Manifest(list(records), last).write(directory)
    if last:
        (directory / f"{last}{LAST_SUFFIX}").symlink_to(last)


def record(step: int, state: str = "complete", loss: float = 1.0, weights_only: bool = False) -> CheckpointRecord:
    return CheckpointRecord(f"step={step}", step, 0, {"loss": loss}, state, weights_only)


def visible(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith(".") and p.name != MANIFEST_NAME)


def test_unfinished_save_is_skipped_then_removed(tmp_path, caplog):
    make_directory(tmp_path, record(2), record(4, "saving"), last="step=2")
    fake_checkpoint(tmp_path / f"{TMP_PREFIX}step=4").joinpath("weights", "metadata.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert AutoResume(resume_if_exists=True).find_checkpoint(tmp_path) == tmp_path / "step=2"
    assert "skipping" in caplog.text and "step=4" in caplog.text and "did not finish" in caplog.text

    ModelCheckpoint(dirpath=tmp_path, monitor="loss").recover(resumed=True)
    assert [r.name for r in Manifest.read(tmp_path).checkpoints] == ["step=2"]
    assert not (tmp_path / f"{TMP_PREFIX}step=4").exists()


def test_checkpoint_renamed_but_not_yet_recorded_is_resumed_and_adopted(tmp_path):
    make_directory(tmp_path, record(2), last="step=2")
    fake_checkpoint(tmp_path / "step=4")
    manifest = Manifest.read(tmp_path)
    manifest.add(record(4, "saving"))
    manifest.write(tmp_path)
    assert AutoResume(resume_if_exists=True).find_checkpoint(tmp_path) == tmp_path / "step=4"

    ModelCheckpoint(dirpath=tmp_path, monitor="loss").recover(resumed=True)
    manifest = Manifest.read(tmp_path)
    assert [(r.name, r.state) for r in manifest.checkpoints] == [("step=2", "complete"), ("step=4", "complete")]
    assert manifest.last == "step=4" and visible(tmp_path) == ["step=2", "step=4", f"step=4{LAST_SUFFIX}"]


def test_async_checkpoint_renamed_but_not_recorded_is_newer_than_the_one_committed_before(tmp_path):
    # two async saves in flight: step 4 commits, then step 6's commit renames it and the process dies
    make_directory(tmp_path, record(2), record(4, "saving"), record(6, "saving"), last="step=2")
    fake_checkpoint(tmp_path / f"{TMP_PREFIX}step=4")
    fake_checkpoint(tmp_path / f"{TMP_PREFIX}step=6")
    ModelCheckpoint(dirpath=tmp_path, monitor="loss", save_top_k=-1)._publish(record(4, "saving"))
    os.replace(tmp_path / f"{TMP_PREFIX}step=6", tmp_path / "step=6")
    assert newest_resumable(tmp_path) == tmp_path / "step=6"
    ModelCheckpoint(dirpath=tmp_path, monitor="loss").recover(resumed=True)
    assert Manifest.read(tmp_path).last == "step=6"


def test_interrupted_deletion_and_link_swap_are_cleaned_up(tmp_path):
    make_directory(tmp_path, record(2, "deleting"), record(4), last="step=4")
    fake_checkpoint(tmp_path / f"{TRASH_PREFIX}step=0")
    (tmp_path / f"{TMP_PREFIX}step=2{LAST_SUFFIX}").symlink_to("step=2")
    assert AutoResume(resume_if_exists=True).find_checkpoint(tmp_path) == tmp_path / "step=4"
    ModelCheckpoint(dirpath=tmp_path, monitor="loss").recover(resumed=True)
    assert [r.name for r in Manifest.read(tmp_path).checkpoints] == ["step=4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST_NAME, "step=4", f"step=4{LAST_SUFFIX}"]


def test_missing_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    make_directory(tmp_path, record(2), record(4), last="step=4")
    os.rename(tmp_path / "step=4", tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING):
        assert AutoResume(resume_if_exists=True).find_checkpoint(tmp_path) == tmp_path / "step=2"
    assert "missing or incomplete" in caplog.text
    ModelCheckpoint(dirpath=tmp_path, monitor="loss").recover(resumed=True)
    assert Manifest.read(tmp_path).last == "step=2" and (tmp_path / f"step=2{LAST_SUFFIX}").is_symlink()
    assert not (tmp_path / f"step=4{LAST_SUFFIX}").is_symlink()


def test_newest_is_the_last_committed_not_the_highest_step(tmp_path):
    # a run resumed from step 2 of a longer one and saved step 3: step 3 is where it continues
    make_directory(tmp_path, record(2), record(6), record(3), last="step=3")
    assert newest_resumable(tmp_path) == tmp_path / "step=3"


def test_weights_only_checkpoint_is_not_resumed_from(tmp_path):
    make_directory(tmp_path, record(4), record(5, weights_only=True), last="step=5")
    assert AutoResume(resume_if_exists=True).find_checkpoint(tmp_path) == tmp_path / "step=4"


def test_resume_options(tmp_path):
    assert AutoResume().find_checkpoint(tmp_path) is None
    assert AutoResume(resume_if_exists=True, resume_ignore_no_checkpoint=True).find_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="resume_ignore_no_checkpoint=True"):
        AutoResume(resume_if_exists=True).find_checkpoint(tmp_path)
    fake_checkpoint(tmp_path / "copied")
    with pytest.raises(FileNotFoundError, match=f"{MANIFEST_NAME} is missing: pass one of its checkpoints"):
        AutoResume(resume_if_exists=True).find_checkpoint(tmp_path)
    assert AutoResume(resume_from_path=str(tmp_path / "copied")).find_checkpoint(None) == tmp_path / "copied"
    (tmp_path / "copied" / "weights" / "metadata.json").unlink()
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        AutoResume(resume_from_path=str(tmp_path / "copied")).find_checkpoint(None)
    other = tmp_path / "other"
    make_directory(other, record(2))
    assert (
        AutoResume(resume_if_exists=True, resume_from_directory=str(other)).find_checkpoint(tmp_path)
        == other / "step=2"
    )


def test_invalid_manifest_is_reported_not_overwritten(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text('{"checkpoints": [{"name": "x"}]')
    with pytest.raises(ValueError, match=f"{MANIFEST_NAME} is not a valid checkpoint manifest"):
        AutoResume(resume_if_exists=True).find_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="fix or remove it"):
        ModelCheckpoint(dirpath=tmp_path).recover(resumed=True)
    assert (tmp_path / MANIFEST_NAME).read_text() == '{"checkpoints": [{"name": "x"}]'


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    make_directory(tmp_path, record(2), last="step=2")
    before = (tmp_path / MANIFEST_NAME).read_text()
    with pytest.raises(FileExistsError, match="holds 1 checkpoints of an earlier run.*AutoResume"):
        ModelCheckpoint(dirpath=tmp_path).recover(resumed=False)
    assert (tmp_path / MANIFEST_NAME).read_text() == before and is_complete(tmp_path / "step=2")


WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
MUTATIONS = {"os.rename", "os.remove", "os.rmdir", "os.symlink", "os.mkdir", "os.link"}


def commit_killed_before_change(directory: Path, kill_at: int) -> None:
    """Commit `step=6` (best loss, so steps 2 and 4 go), SIGKILLed right before file-system change `kill_at`."""
    changes = 0

    def kill_at_change(event: str, args: tuple) -> None:
        nonlocal changes
        if event in MUTATIONS or (event == "open" and isinstance(args[2], int) and args[2] & WRITE_FLAGS):
            changes += 1
            if changes == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    callback = ModelCheckpoint(dirpath=directory, monitor="loss", save_top_k=1)
    sys.addaudithook(kill_at_change)
    callback._delete(callback._publish(record(6, "saving", loss=0.5)))


def test_commit_killed_at_every_file_system_change(tmp_path):
    fork = multiprocessing.get_context("fork")
    outcomes = []
    for kill_at in range(1, 100):
        directory = tmp_path / f"kill{kill_at}"
        make_directory(
            directory, record(2, loss=2.0), record(4, loss=1.0), record(6, "saving", loss=0.5), last="step=4"
        )
        fake_checkpoint(directory / f"{TMP_PREFIX}step=6", b"new")
        process = fork.Process(target=commit_killed_before_change, args=(directory, kill_at))
        process.start()
        process.join(30)
        outcomes.append(process.exitcode)

        Manifest.read(directory)  # never a partial file
        for name in visible(directory):
            path = directory / name
            assert is_complete(path.resolve()), f"kill {kill_at}: {name} is visible but incomplete"
        resumed = newest_resumable(directory)
        new_visible = (directory / "step=6").exists()
        assert resumed == directory / ("step=6" if new_visible else "step=4"), f"kill {kill_at}: resumes {resumed}"
        if new_visible:
            assert (directory / "step=6" / "weights" / "__0_0.distcp").read_bytes() == b"new"

        ModelCheckpoint(dirpath=directory, monitor="loss", save_top_k=1).recover(resumed=True)
        manifest = Manifest.read(directory)
        assert all(r.state == "complete" for r in manifest.checkpoints)
        assert sorted(r.name for r in manifest.checkpoints) == [
            n for n in visible(directory) if not n.endswith(LAST_SUFFIX)
        ]
        assert [n for n in visible(directory) if n.endswith(LAST_SUFFIX)] == [f"{manifest.last}{LAST_SUFFIX}"]
        assert newest_resumable(directory) == resumed, f"kill {kill_at}: recovery changed the resume point"
        assert not any(p.name.startswith((TMP_PREFIX, TRASH_PREFIX)) for p in directory.iterdir())
        if process.exitcode == 0:
            assert visible(directory) == ["step=6", f"step=6{LAST_SUFFIX}"]
            break
    assert outcomes[:-1] == [-signal.SIGKILL] * (len(outcomes) - 1) and outcomes[-1] == 0
    assert len(outcomes) > 10, json.dumps(outcomes)


def test_failed_save_that_would_replace_a_checkpoint_gives_it_back(tmp_path):
    # a run resumed from step 2 re-saves step 4, whose save fails: the earlier step-4 checkpoint stays listed
    make_directory(tmp_path, record(2), record(4, loss=3.0), record(6), last="step=6")
    previous = Manifest.read(tmp_path).checkpoints
    manifest = Manifest.read(tmp_path)
    failed = record(4, "saving", loss=1.0)
    manifest.add(failed)
    manifest.write(tmp_path)
    fake_checkpoint(tmp_path / f"{TMP_PREFIX}step=4")
    ModelCheckpoint(dirpath=tmp_path, monitor="loss")._abort(failed, tmp_path / f"{TMP_PREFIX}step=4", (1, previous[1]))
    assert Manifest.read(tmp_path).checkpoints == previous
    assert not (tmp_path / f"{TMP_PREFIX}step=4").exists()


def test_save_failing_after_its_commit_keeps_the_committed_checkpoint(tmp_path):
    # rank 0 published step 4, then the broadcast after it failed because another rank died
    make_directory(tmp_path, record(2), record(4, "saving"), last="step=2")
    fake_checkpoint(tmp_path / f"{TMP_PREFIX}step=4")
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="loss", save_top_k=-1)
    committed = record(4, "saving")
    callback._publish(committed)
    callback._abort(committed, tmp_path / f"{TMP_PREFIX}step=4", None)
    assert [(r.name, r.state) for r in Manifest.read(tmp_path).checkpoints] == [
        ("step=2", "complete"),
        ("step=4", "complete"),
    ]


def test_commit_leaves_removing_files_to_a_background_thread_and_teardown_waits_for_it(tmp_path, monkeypatch):
    make_directory(tmp_path, record(2, loss=2.0), record(4, loss=1.0), last="step=4")
    release, removing = threading.Event(), []
    rmtree = shutil.rmtree

    def slow_rmtree(path, ignore_errors=False):
        removing.append(Path(path).name)
        release.wait(30)
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="loss", save_top_k=1)
    callback._delete(["step=2"], background=True)  # returns while the files are still being removed

    assert [r.name for r in Manifest.read(tmp_path).checkpoints] == ["step=4"]
    assert visible(tmp_path) == ["step=4", f"step=4{LAST_SUFFIX}"]
    (trash,) = [p for p in tmp_path.iterdir() if p.name.startswith(f"{TRASH_PREFIX}step=2.")]
    assert (trash / "weights").is_dir() and removing in ([], [trash.name])
    release.set()
    callback.teardown(None, None, "fit")
    assert not trash.exists() and removing == [trash.name]

"""One writer per checkpoint directory: a second run on a folder another run holds is refused at start, naming the
holder (before launch, and in training); the lock dies with its process (SIGKILL leaves none); retention deletes
only checkpoints of the run's own lineage."""

import os
import signal
from pathlib import Path

import pytest

from nemo_ckpt.checkpoint.layout import LOCK_NAME
from nemo_ckpt.checkpoint.lock import DirectoryLock, DirectoryLockedError
from nemo_ckpt.checkpoint.manifest import CheckpointRecord, Manifest
from nemo_ckpt.checkpoint.model_checkpoint import ModelCheckpoint
from nemo_ckpt.preflight import PreflightError, check_task
from recipes import pretrain_recipe
from tests.helpers.distributed import forkserver, run_distributed
from tests.helpers.recipe import RUN_NAME, checkpoint_dir, train


def hold_lock(directory: str, connection) -> None:
    """A process holding `directory`'s lock, as a training run's rank 0 does, until its parent closes the pipe."""
    os.environ["SLURM_JOB_ID"] = "4242"
    lock = DirectoryLock(directory)
    lock.acquire()
    connection.send("held")
    try:
        connection.recv()
    except EOFError:
        pass


@pytest.fixture
def holder(tmp_path):
    """A child process holding the lock of the tiny recipe's checkpoint directory under `tmp_path`."""
    directory = checkpoint_dir(tmp_path)
    directory.mkdir(parents=True)
    context = forkserver()
    ours, theirs = context.Pipe()
    process = context.Process(target=hold_lock, args=(str(directory), theirs))
    process.start()
    theirs.close()
    assert ours.poll(120) and ours.recv() == "held", "the holder did not take the lock"
    yield process
    ours.close()  # the holder's recv ends (if it still lives), and with it the process
    process.join(60)


def train_into(rank: int, world_size: int, root: str, max_steps: int = 2) -> None:
    train(Path(root), max_steps, world_size, every_n_train_steps=1)


def test_a_second_run_on_a_held_folder_is_refused_naming_the_holder(tmp_path, holder):
    recipe = pretrain_recipe(name=RUN_NAME, dir=str(tmp_path))
    pattern = rf"is being written by another run \(host=\S+ pid={holder.pid} started=\S+ slurm_job_id=4242\)"
    with pytest.raises(PreflightError, match=pattern):
        check_task(recipe)
    with pytest.raises(Exception, match=pattern):
        run_distributed(train_into, 2, str(tmp_path))
    assert not Manifest.read(checkpoint_dir(tmp_path)).checkpoints, "the refused run wrote nothing"


def test_the_lock_dies_with_its_process(tmp_path, holder):
    with pytest.raises(DirectoryLockedError):
        DirectoryLock(checkpoint_dir(tmp_path)).acquire()
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(60)
    lock = DirectoryLock(checkpoint_dir(tmp_path))
    lock.acquire()  # no stale lock: the kernel released it with the process
    assert lock.held and (checkpoint_dir(tmp_path) / LOCK_NAME).is_file()
    lock.release()


def test_runs_release_the_lock_and_a_resumed_run_continues_its_lineage(tmp_path):
    run_distributed(train_into, 2, str(tmp_path))
    DirectoryLock(checkpoint_dir(tmp_path)).check_free()  # released at teardown
    run_distributed(train_into, 2, str(tmp_path), 4)
    records = Manifest.read(checkpoint_dir(tmp_path)).complete()
    assert [record.step for record in records][-1] == 4
    assert len({record.lineage for record in records}) == 1 and records[0].lineage is not None


def test_retention_deletes_only_checkpoints_of_its_own_lineage():
    ours = [CheckpointRecord(f"ours-{step}", step, 0, {"loss": 1.0 / step}, "complete", lineage="a") for step in (1, 2)]
    theirs = [CheckpointRecord(f"theirs-{step}", step, 0, {"loss": 0.0}, "complete", lineage="b") for step in (1, 2)]
    older = CheckpointRecord("older", 1, 0, {"loss": 9.0}, "complete")  # written by 0.2: no lineage
    callback = ModelCheckpoint(monitor="loss", save_top_k=1)
    callback.lineage = "a"
    stale = callback.stale_checkpoints(Manifest([older, *theirs, *ours]))
    assert [record.name for record in stale] == ["ours-1"]

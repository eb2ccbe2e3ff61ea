"""The tiny recipe as real Slurm jobs (1 node x 2 torchrun ranks): train, then resume in a second job; a job's
account. The command line's submission, preemption and requeue are tested on two nodes (`test_two_nodes.py`), where
each node runs 1 or 2 ranks."""

import json
import subprocess
import sys
import time
from pathlib import Path

import nemo_run as run
import pytest

from launch.slurm import slurm_executor
from recipes import pretrain_recipe
from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import job_log, logged_steps, nemo

JOB_PATH = f"{Path(sys.executable).parent}:$PATH"  # torchrun and python of this venv


def tiny(log_dir: Path, max_steps: int, every_n_train_steps: int) -> run.Partial:
    recipe = pretrain_recipe(name="tiny", dir=str(log_dir), max_steps=max_steps)
    recipe.log.ckpt.every_n_train_steps = every_n_train_steps
    recipe.log.ckpt.save_top_k = -1
    return recipe


def submit(recipe: run.Partial, **executor_args) -> tuple[str, str, Path]:
    """Submit `recipe` detached through NeMo-Run; return (experiment id, Slurm job id, job dir)."""
    executor = slurm_executor(ntasks_per_node=2, time="00:10:00", env_vars={"PATH": JOB_PATH}, **executor_args)
    with run.Experiment("tiny", executor=executor, log_level="WARN") as exp:
        exp.add(recipe, name="pretrain")
        exp.run(detach=True)
        return exp._id, exp.jobs[0].handle.rsplit("/", 1)[-1], Path(exp.jobs[0].executor.job_dir)


def manifest(log_dir: Path) -> dict:
    return json.loads((log_dir / "tiny" / "checkpoints" / "checkpoints.json").read_text())


def checkpoint_of(log_dir: Path, step: int) -> Path:
    [name] = [record["name"] for record in manifest(log_dir)["checkpoints"] if record["step"] == step]
    return log_dir / "tiny" / "checkpoints" / name


def test_recipe_trains_checkpoints_and_resumes(slurm_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path) -> None:
    log_dir = tmp_path / "runs"
    exp_id, job_id, job_dir = submit(tiny(log_dir, max_steps=10, every_n_train_steps=5))

    info = slurm_cluster.wait(job_id, timeout=180)

    log = job_log(job_dir, job_id)
    assert info["JobState"] == "COMPLETED", log
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in log and "GLOBAL_RANK: 1, MEMBER: 2/2" in log
    assert "`Trainer.fit` stopped: `max_steps=10` reached." in log
    assert [record["step"] for record in manifest(log_dir)["checkpoints"]] == [5, 10]
    weights = checkpoint_of(log_dir, 10) / "weights"
    assert json.loads((weights / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert sorted(p.name for p in weights.glob("*.distcp")) == [  # 2 writers per rank; replicas split over ranks
        "__0_0.distcp",
        "__0_1.distcp",
        "__1_0.distcp",
        "__1_1.distcp",
    ]
    assert logged_steps(log_dir) == list(range(10))

    status = nemo("experiment", "status", exp_id)
    assert "Status: SUCCEEDED" in status and f"Job id: {job_id}" in status
    assert "`Trainer.fit` stopped: `max_steps=10` reached." in nemo("experiment", "logs", exp_id, "0")

    _, resume_id, resume_dir = submit(tiny(log_dir, max_steps=15, every_n_train_steps=5))

    info = slurm_cluster.wait(resume_id, timeout=180)

    log = job_log(resume_dir, resume_id)
    assert info["JobState"] == "COMPLETED", log
    assert f"Restoring states from the checkpoint path at {checkpoint_of(log_dir, 10)}" in log
    assert logged_steps(log_dir) == list(range(10, 15)), "the resumed job starts at the saved step"
    assert [record["step"] for record in manifest(log_dir)["checkpoints"]] == [5, 10, 15]


@pytest.mark.parametrize("account", ["nemo_ckpt", "other"])
def test_job_runs_under_a_valid_account(slurm_cluster: SlurmCluster, tmp_path: Path, account: str) -> None:
    job_id = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--account={account}",
            "--time=00:01:00",
            f"--output={tmp_path / 'out.txt'}",
            "--wrap=true",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert slurm_cluster.wait(job_id)["Account"] == account
    deadline = time.monotonic() + 30
    while (
        sacct := subprocess.run(
            ["sacct", "-X", "--noheader", "--parsable2", "--format=Account,State", "-j", job_id],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
    ) != [f"{account}|COMPLETED"]:
        assert time.monotonic() < deadline, f"sacct still shows {sacct}"  # records reach slurmdbd asynchronously
        time.sleep(0.5)

"""The tiny recipe as real Slurm jobs (1 node x 2 torchrun ranks): train, resume, preempt and requeue."""

import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import nemo_run as run
import pytest

from launch.slurm import slurm_executor
from nemo_ckpt.logger.runs import version_dirs
from recipes import pretrain_recipe
from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import attempts, job_log, nemo

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


def logged_steps(log_dir: Path) -> list[int]:
    """Training steps in the CSV metrics of the latest run (NeMoLogger version)."""
    with open(version_dirs(log_dir / "tiny")[-1] / "metrics.csv") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row["reduced_train_loss"]]


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


def test_command_line_submits_to_slurm_and_waits(
    slurm_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    log_dir = tmp_path / "runs"
    output = nemo(
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny",
        "trainer.max_steps=6",
        "log.ckpt.every_n_train_steps=3",
        f"log.log_dir={log_dir}",
        "run.executor=slurm",
        "run.executor.ntasks_per_node=2",
        "run.executor.time=00:10:00",
        f"run.executor.env_vars={{'PATH': '{JOB_PATH}'}}",
        "--yes",
    )

    [job_dir] = (nemorun_home / "experiments").glob("pretrain/pretrain_*/pretrain")
    [log_file] = job_dir.glob("log-nemo_ckpt.pretrain_*.out")
    assert "SUCCEEDED" in output, output
    assert "`Trainer.fit` stopped: `max_steps=6` reached." in log_file.read_text()
    assert [record["step"] for record in manifest(log_dir)["checkpoints"]][-1] == 6
    assert (checkpoint_of(log_dir, 6) / "weights" / "metadata.json").is_file()


def test_preemption_signal_checkpoints_requeues_and_resumes(
    slurm_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    log_dir = tmp_path / "runs"
    max_steps = 50
    exp_id, job_id, job_dir = submit(tiny(log_dir, max_steps=max_steps, every_n_train_steps=10), signal="USR1@60")
    deadline = time.monotonic() + 120
    while not (log_dir / "tiny" / "checkpoints" / "checkpoints.json").exists() or not manifest(log_dir)["checkpoints"]:
        assert time.monotonic() < deadline, f"no checkpoint yet: {slurm_cluster.job(job_id)}"
        time.sleep(0.2)

    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)  # what Slurm sends before the time limit
    info = slurm_cluster.wait(job_id, timeout=240)

    log = job_log(job_dir, job_id)
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1"
    first, second = attempts(log, job_id)
    [saved] = [line for line in first.splitlines() if "Received SIGUSR1: saved" in line]
    step = int(saved.rsplit(" at step ", 1)[1].split(";")[0])
    assert 10 <= step < max_steps - 10, "the signal arrived mid-training"
    assert f"Requeueing Slurm job {job_id} to resume from step {step}" in first
    assert f"Restoring states from the checkpoint path at {checkpoint_of(log_dir, step)}" in second
    assert "Received SIGUSR1" not in second
    assert logged_steps(log_dir) == list(range(step, max_steps)), "the requeued job resumes at the saved step"
    steps = [record["step"] for record in manifest(log_dir)["checkpoints"]]
    assert step in steps and steps[-1] == max_steps
    assert f"`Trainer.fit` stopped: `max_steps={max_steps}` reached." in second
    shown = nemo("experiment", "logs", exp_id, "0")  # NeMo-Run's own view of the job: both attempts
    assert re.findall(rf"Slurm job {job_id}: attempt (\d+)", shown) == ["1", "2"]
    assert f"Requeueing Slurm job {job_id} to resume from step {step}" in shown
    assert f"`Trainer.fit` stopped: `max_steps={max_steps}` reached." in shown


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

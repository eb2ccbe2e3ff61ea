"""`nemo nemo_ckpt pretrain ... run.executor=slurm --yes` on a real Slurm: it waits for the job and exits with its
end (0 completed, 1 failed, with `error: ...`); with `--detach` it exits 0 once the job is submitted; a scancel'd
job's ranks save a checkpoint at the end of their step (SIGTERM) and the job is not requeued."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import commands
from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import REPO

JOB_PATH = f"{Path(sys.executable).parent}:$PATH"  # torchrun and python of this venv


def nemo(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The tiny recipe on 1 node x 2 ranks through the command line, its logs and checkpoints under tmp_path/runs."""
    return commands.nemo(
        *("nemo_ckpt", "pretrain", "--factory", "tiny", f"log.log_dir={tmp_path / 'runs'}"),
        *("run.executor=slurm", "run.executor.ntasks_per_node=2", "run.executor.time=00:10:00"),
        f"run.executor.env_vars={{'PATH': '{JOB_PATH}'}}",
        *overrides,
        "--yes",
        cwd=REPO,
        env=dict(os.environ),
        timeout=300,
    )


def steps(tmp_path: Path) -> list[int]:
    manifest = json.loads((tmp_path / "runs" / "tiny" / "checkpoints" / "checkpoints.json").read_text())
    return [record["step"] for record in manifest["checkpoints"] if record["state"] == "complete"]


def test_the_command_waits_and_exits_with_the_job_s_end(
    slurm_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    completed = nemo(tmp_path, "trainer.max_steps=2")
    assert completed.returncode == 0, completed.stdout
    assert "finished: SUCCEEDED" in completed.stdout and steps(tmp_path) == [2]

    failed = nemo(tmp_path, "trainer.max_steps=4", "trainer.accelerator=tpu")  # the Trainer is built on the ranks
    assert failed.returncode == 1, failed.stdout
    assert re.search(r"^error: pretrain FAILED; its log: nemo experiment logs pretrain_\d+ 0$", failed.stdout, re.M)


def test_detached_the_command_exits_once_submitted_and_scancel_checkpoints(
    slurm_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path
) -> None:
    submitted = nemo(tmp_path, "trainer.max_steps=100000", "log.ckpt.every_n_train_steps=100000", "--detach")
    assert submitted.returncode == 0, submitted.stdout
    job_id = re.search(r"Job id: (\d+)", submitted.stdout)[1]
    [job_dir] = (nemorun_home / "experiments" / "pretrain").glob("pretrain_*/pretrain")
    log = job_dir / f"log-nemo_ckpt.pretrain_{job_id}.out"
    deadline = time.monotonic() + 240
    while not (log.exists() and "iteration 2/100000" in log.read_text()):
        assert time.monotonic() < deadline, f"job {job_id} did not start training: {slurm_cluster.job(job_id)}"
        time.sleep(0.5)

    subprocess.run(["scancel", job_id], check=True)  # SIGTERM to torchrun and the ranks, SIGKILL after KillWait

    info = slurm_cluster.wait(job_id, timeout=120)
    text = log.read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    step = int(re.search(r"Received SIGTERM: saved \S+ at step (\d+); stopping", text)[1])
    assert steps(tmp_path) == [step] and "Requeueing" not in text

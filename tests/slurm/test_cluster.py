"""The local Slurm cluster runs real batch jobs with job steps."""

import subprocess

from tests.slurm.cluster import SlurmCluster


def test_node_is_idle(slurm_cluster: SlurmCluster) -> None:
    out = subprocess.run(
        ["sinfo", "--noheader", "--format=%P %t %D"], check=True, capture_output=True, text=True
    ).stdout
    assert out.split() == ["debug*", "idle", "1"]


def test_sbatch_two_task_job(slurm_cluster: SlurmCluster, tmp_path) -> None:
    output = tmp_path / "out_%j.txt"
    job_id = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--ntasks=2",
            "--time=00:01:00",
            f"--output={output}",
            "--wrap",
            "srun hostname; echo SLURM_NTASKS=$SLURM_NTASKS",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()

    info = slurm_cluster.wait(job_id)

    assert info["JobState"] == "COMPLETED"
    assert info["ExitCode"] == "0:0"
    assert info["NumTasks"] == "2"
    lines = (tmp_path / f"out_{job_id}.txt").read_text().split()
    hostname = subprocess.run(["hostname"], check=True, capture_output=True, text=True).stdout.strip()
    assert lines == [hostname, hostname, "SLURM_NTASKS=2"]


def test_failed_job_reports_exit_code(slurm_cluster: SlurmCluster, tmp_path) -> None:
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--time=00:01:00", f"--output={tmp_path / 'out.txt'}", "--wrap", "exit 3"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()

    info = slurm_cluster.wait(job_id)

    assert info["JobState"] == "FAILED"
    assert info["ExitCode"] == "3:0"

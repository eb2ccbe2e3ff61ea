"""NeMo-Run submits through launch.slurm.slurm_executor to the real local Slurm cluster."""

import sys
from pathlib import Path

import nemo_run as run
import pytest

from launch.slurm import check_submittable, slurm_executor
from tests.slurm.cluster import SlurmCluster
from tests.slurm.jobs import job_log

ALLREDUCE = """\
import pathlib, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(f"rank {rank}/{world} sum {total.item()}", flush=True)
pathlib.Path(sys.argv[1], f"rank{rank}.txt").write_text(f"{world} {total.item()}")
dist.destroy_process_group()
"""


def test_experiment_runs_torchrun_allreduce(slurm_cluster: SlurmCluster, nemorun_home: Path, tmp_path: Path) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    executor = slurm_executor(
        partition="debug",
        nodes=1,
        ntasks_per_node=2,
        time="00:05:00",
        env_vars={"PATH": f"{Path(sys.executable).parent}:$PATH"},
        signal="USR1@30",
    )

    with run.Experiment("allreduce", executor=executor, log_level="WARN") as exp:
        exp.add(run.Script(path=str(script), entrypoint="python", args=[str(out_dir)]), name="allreduce")
        exp.run(detach=True)
        job_id = exp.jobs[0].handle.rsplit("/", 1)[-1]
        job_dir = Path(exp.jobs[0].executor.job_dir)

    info = slurm_cluster.wait(job_id, timeout=120)
    log = job_log(job_dir, job_id, task="allreduce")
    assert info["JobState"] == "COMPLETED", (job_dir / f"sbatch_nemo_ckpt.allreduce_{job_id}.out").read_text()
    assert info["JobName"] == "nemo_ckpt.allreduce"
    assert info["Requeue"] == "1"
    assert job_dir.parent.parent.parent == nemorun_home / "experiments"
    assert [(out_dir / f"rank{r}.txt").read_text() for r in (0, 1)] == ["2 3.0", "2 3.0"]
    assert "rank 0/2 sum 3.0" in log and "rank 1/2 sum 3.0" in log
    assert f"{job_id} = " in (nemorun_home / ".slurm_jobs").read_text()


def test_check_submittable_accepts_fitting_job(slurm_cluster: SlurmCluster) -> None:
    message = check_submittable(slurm_executor(partition="debug", ntasks_per_node=2, time="01:00:00"))
    assert "to start at" in message and "partition debug" in message


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"partition": "nope"}, "Invalid partition name"),
        ({"time": "05:00:00"}, "time limit"),
        ({"nodes": 2}, "Node count specification invalid"),
        ({"gpus_per_node": 1}, "gres"),
        ({"account": "nope"}, "Invalid account.*set account= to one of your Slurm accounts \\(account='nope'"),
    ],
)
def test_check_submittable_rejects_what_the_cluster_cannot_run(
    slurm_cluster: SlurmCluster, kwargs: dict, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        check_submittable(slurm_executor(**kwargs))

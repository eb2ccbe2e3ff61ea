"""`nemo nemo_ckpt pretrain --dryrun` with a Slurm executor prints the sbatch script it would submit."""

import os
import subprocess
import sys
from pathlib import Path


def test_slurm_dryrun_prints_sbatch_script_and_submits_nothing(tmp_path):
    nemo = Path(sys.executable).with_name("nemo")
    env = {**os.environ, "NEMORUN_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [
            str(nemo),
            "nemo_ckpt",
            "pretrain",
            "--factory",
            "tiny",
            "trainer.max_steps=20",
            "run.executor=slurm",
            "run.executor.account=llm",
            "run.executor.nodes=2",
            "run.executor.ntasks_per_node=4",
            "run.executor.time=01:00:00",
            "--dryrun",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "#SBATCH --account=llm" in lines and "#SBATCH --nodes=2" in lines and "#SBATCH --time=01:00:00" in lines
    [srun] = [line for line in lines if line.startswith("srun ")]
    assert "torchrun" in srun and "--nnodes 2" in srun and "--nproc-per-node 4" in srun
    assert "--rdzv-endpoint $head_node_ip:29500" in srun and "nemo_run.core.runners.fdl_runner" in srun
    assert not list((tmp_path / "home").rglob("*_sbatch.sh")), "the dry run leaves no experiment behind"

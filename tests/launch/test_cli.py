"""The `nemo nemo_ckpt pretrain` command line: `--dryrun` with a Slurm executor prints the sbatch script it would
submit; `--to-yaml` exports a recipe that `--yaml` reads back."""

import os
import subprocess
from pathlib import Path

import yaml

from tests.helpers import commands


def test_slurm_dryrun_prints_sbatch_script_and_submits_nothing(tmp_path):
    result = commands.nemo(
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny",
        "trainer.max_steps=20",
        "trainer.num_nodes=2",
        "trainer.devices=4",
        "data.global_batch_size=32",
        "run.executor=slurm",
        "run.executor.account=llm",
        "run.executor.nodes=2",
        "run.executor.ntasks_per_node=4",
        "run.executor.time=01:00:00",
        "--dryrun",
        env={**os.environ, "NEMORUN_HOME": str(tmp_path / "home")},
    )
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert "#SBATCH --account=llm" in lines and "#SBATCH --nodes=2" in lines and "#SBATCH --time=01:00:00" in lines
    [srun] = [line for line in lines if line.startswith("srun ")]
    assert "torchrun" in srun and "--nnodes 2" in srun and "--nproc-per-node 4" in srun
    assert "--rdzv-endpoint $head_node_ip:29500" in srun and "nemo_run.core.runners.fdl_runner" in srun
    assert not list((tmp_path / "home").rglob("*_sbatch.sh")), "the dry run leaves no experiment behind"


def nemo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = commands.nemo(
        "nemo_ckpt", "pretrain", *args, cwd=cwd, env={**os.environ, "NEMORUN_HOME": str(cwd / "home")}
    )
    assert result.returncode == 0, result.stdout
    return result


def test_to_yaml_sections_read_back_with_yaml(tmp_path):
    """`--to-yaml` exports the recipe; its sections, edited, go back in with `--yaml` (`run.factory` + overrides).

    NeMo-Run 0.11.1 does not read a whole export back (top-level `_target_`/`_partial_`, lists of configs such
    as `trainer.callbacks`), so the sections are passed under the factory. `every_n_train_steps` is `int | None`:
    the command line parses it since `launch.cli` registers PEP 604 unions with NeMo-Run.
    """
    nemo(
        "--factory",
        "tiny",
        "model.config.num_layers=3",
        "log.ckpt.every_n_train_steps=5",
        "--to-yaml",
        "recipe.yaml",
        cwd=tmp_path,
    )
    exported = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert exported["model"]["config"]["num_layers"] == 3 and exported["log"]["ckpt"]["every_n_train_steps"] == 5
    edited = {
        "run": {"factory": "tiny"},
        "model": exported["model"],
        "log": exported["log"],
        "trainer": {"max_steps": 7},
    }
    edited["model"]["config"]["hidden_size"] = 32
    (tmp_path / "edited.yaml").write_text(yaml.safe_dump(edited))

    nemo("--yaml", "edited.yaml", "trainer.val_check_interval=5", "--to-yaml", "again.yaml", cwd=tmp_path)

    again = yaml.safe_load((tmp_path / "again.yaml").read_text())
    exported["trainer"] |= {"max_steps": 7, "val_check_interval": 5}
    assert again == exported

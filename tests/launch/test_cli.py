"""The `nemo nemo_ckpt pretrain` command line: `--dryrun` with a Slurm executor prints the sbatch script it would
submit; `--to-yaml` exports a recipe that `--yaml` reads back; what a user can fix is refused before launch with
one line (`error: ...`, exit 2); a failed job fails the command (exit 1)."""

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
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
        cwd=tmp_path,
        env={**os.environ, "NEMORUN_HOME": str(tmp_path / "home")},
    )
    assert result.returncode == 0, result.stdout
    assert "warning: log.log_dir='nemo_experiments' is relative: on the compute node" in result.stdout
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


def environment(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment, NeMo-Run's home under `tmp_path`, and the test's Python first on PATH (torchrun found)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "PATH": path, **extra}


def marked(variable: str, value: str) -> list[int]:
    """The processes whose environment has `variable=value`."""
    entry = f"{variable}={value}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_missing_data_path_is_refused_before_anything_is_launched(tmp_path):
    """The real command: `error: <message>` alone on stderr, exit 2, no config dump, no experiment, no torchrun."""
    run_id = uuid.uuid4().hex
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "nemo"),
            "nemo_ckpt",
            "pretrain",
            "--factory",
            "tiny(data=real)",
            "data.paths=/nonexistent/x",
            "data.tokenizer=byte-level",
            "run.executor=local",
            "--yes",
        ],
        cwd=tmp_path,
        env=environment(tmp_path, NEMO_CKPT_TEST_RUN=run_id),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("error: data: ") and "/nonexistent/x" in line, line
    assert "Resolved Arguments" not in result.stdout and "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "home" / "experiments").exists(), "no experiment was prepared"
    assert marked("NEMO_CKPT_TEST_RUN", run_id) == [], "no torchrun"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.strategy.ckpt_async_sav=True", "trainer.strategy: unknown option `ckpt_async_sav`; did you mean"),
        ("trainer.strategy.use_sharp=True", "trainer.strategy: not supported: use_sharp (NeMo meaning: SHARP"),
        ("trainer.foo.bar=1", "trainer: unknown option `foo`"),
        ("trainer.max_steps=ten", "trainer.max_steps=ten: cannot parse 'ten' as int: Invalid integer literal"),
        ("run.executor.ntasks_per_nod=2", "local_executor: unknown option `ntasks_per_nod`; did you mean"),
        ("run.executor.ntasks_per_node=0", "invalid local executor: ntasks_per_node must be an integer >= 1, got 0"),
        ("resume.resume_from_path=/nonexistent/ckpt", "/nonexistent/ckpt"),
        ("trainer..max_steps=5", "the key 'trainer..max_steps' has an empty name between dots; did you mean"),
        ("trainer.max_steps=-5", "trainer.max_steps=-5: use a positive number of steps (or -1: no limit)"),
        ("model.config.hidden_size=0", "model: GPTConfig.hidden_size=0: use a positive integer"),
        ("data.micro_batch_size=0", "data: MockDataModule(micro_batch_size=0): use 1 or more"),
    ],
)
def test_options_a_user_can_fix_are_one_line_errors_before_launch(tmp_path, override, message):
    result = commands.nemo(
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny",
        override,
        "run.executor=local",
        "--yes",
        "--dryrun",
        cwd=tmp_path,
        env=environment(tmp_path),
    )
    assert result.returncode == 2, result.stdout
    lines = result.stdout.splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], result.stdout
    assert "Resolved Arguments" not in result.stdout and "Argument:" not in result.stdout, result.stdout


def test_restore_config_true_is_set_on_the_command_line(tmp_path):
    result = nemo("--factory", "tiny", "resume.restore_config=True", "--to-yaml", "recipe.yaml", cwd=tmp_path)
    exported = yaml.safe_load((tmp_path / "recipe.yaml").read_text())
    assert exported["resume"]["restore_config"] is True, result.stdout


def test_a_job_that_fails_fails_the_command(tmp_path):
    """The Trainer is built on the ranks only: an accelerator this machine lacks fails there, after torchrun."""
    result = commands.nemo(
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny",
        "trainer.max_steps=2",
        "trainer.accelerator=tpu",
        "run.executor=local",
        "--yes",
        cwd=tmp_path,
        env=environment(tmp_path),
    )
    assert result.returncode == 1, result.stdout
    assert "finished: FAILED" in result.stdout
    assert re.search(r"^error: pretrain FAILED; its log: nemo experiment logs pretrain_\d+ 0$", result.stdout, re.M)

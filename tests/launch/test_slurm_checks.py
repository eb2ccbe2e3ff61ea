"""launch.slurm.check_layout: a recipe whose Trainer does not fit the Slurm executor's job is rejected before `sbatch`
runs, with the settings named and both ways to fix them; the command line submits nothing. A relative log or job
directory, which would resolve on the compute node, is warned of."""

import io
import os
import sys
import warnings
from pathlib import Path

import nemo_run as run
import pytest

from launch.slurm import SlurmPathWarning, check_layout, slurm_executor
from recipes import pretrain_recipe
from tests.helpers import commands


@pytest.fixture(autouse=True)
def readable_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO())


def recipe(num_nodes: int = 2, devices: int = 2, **strategy: int) -> run.Partial:
    task = pretrain_recipe(num_nodes=num_nodes, num_gpus_per_node=devices)
    for name, value in strategy.items():
        setattr(task.trainer.strategy, name, value)
    return task


def test_fitting_recipe_and_script_pass() -> None:
    check_layout(recipe(num_nodes=2, devices=2), slurm_executor(nodes=2, ntasks_per_node=2))
    check_layout(
        recipe(num_nodes=2, devices=2, tensor_model_parallel_size=2), slurm_executor(nodes=2, ntasks_per_node=2)
    )
    check_layout(run.Script(inline="hostname"), slurm_executor(nodes=4))


@pytest.mark.parametrize(
    "task, nodes, ntasks_per_node, error",
    [
        (
            recipe(num_nodes=1, devices=2),
            2,
            2,
            "trainer.num_nodes=1 but the executor has nodes=2: set trainer.num_nodes=2 or run.executor.nodes=1",
        ),
        (
            recipe(num_nodes=2, devices=2),
            2,
            1,
            "trainer.devices=2 but the executor starts ntasks_per_node=1 ranks per node: set trainer.devices=1 or "
            "run.executor.ntasks_per_node=2",
        ),
        (
            recipe(tensor_model_parallel_size=3),
            2,
            2,
            "tensor_model_parallel_size=3 x pipeline_model_parallel_size=1 x context_parallel_size=1 = 3 must divide "
            "the world size 4; .* \\(world size = nodes=2 x ntasks_per_node=2\\)",
        ),
        (
            recipe(pipeline_model_parallel_size=2, context_parallel_size=3),
            2,
            2,
            "pipeline_model_parallel_size=2 x context_parallel_size=3 = 6 must divide the world size 4",
        ),
        (
            recipe(expert_model_parallel_size=3),
            2,
            2,
            "expert_model_parallel_size=3 must divide data_parallel_size x context_parallel_size = 4 x 1",
        ),
    ],
)
def test_mismatch_is_rejected(task: run.Partial, nodes: int, ntasks_per_node: int, error: str) -> None:
    with pytest.raises(ValueError, match=f"recipe and Slurm executor do not fit: .*{error}"):
        check_layout(task, slurm_executor(nodes=nodes, ntasks_per_node=ntasks_per_node))


def test_global_batch_must_split_over_the_data_parallel_ranks() -> None:
    task = recipe(num_nodes=2, devices=2)
    task.data.global_batch_size = 24  # micro batch 4 x dp 4 = 16
    with pytest.raises(ValueError, match="data.global_batch_size=24 is not a multiple of data.micro_batch_size=4 x "):
        check_layout(task, slurm_executor(nodes=2, ntasks_per_node=2))
    task.trainer.strategy.tensor_model_parallel_size = 4  # dp 1: 24 = 6 micro batches of 4
    check_layout(task, slurm_executor(nodes=2, ntasks_per_node=2))


def test_every_mismatch_is_reported_at_once() -> None:
    with pytest.raises(ValueError, match="trainer.num_nodes=1 .*trainer.devices=1 .*tensor_model_parallel_size=5"):
        check_layout(
            recipe(num_nodes=1, devices=1, tensor_model_parallel_size=5), slurm_executor(nodes=2, ntasks_per_node=2)
        )


def test_command_line_rejects_a_mismatch_and_submits_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    result = commands.nemo(
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny",
        "run.executor=slurm",
        "run.executor.nodes=2",
        "--yes",
        cwd=tmp_path,
        env={**os.environ, "NEMORUN_HOME": str(home), "SLURM_CONF": str(tmp_path / "no-cluster.conf")},
    )
    output = result.stdout
    assert result.returncode == 2 and output.splitlines()[-1].startswith("error: recipe and Slurm executor do not fit")
    assert "warning: log.log_dir='nemo_experiments' is relative: on the compute node it resolves" in output
    assert "trainer.num_nodes=1 but the executor has nodes=2: set trainer.num_nodes=2 or run.executor.nodes=1" in output
    assert "trainer.devices=2 but the executor starts ntasks_per_node=1 ranks per node" in output
    assert not list(home.rglob("*_sbatch.sh")) and not (home / ".slurm_jobs").exists(), "nothing submitted"


def test_relative_log_and_job_directories_are_warned_of(tmp_path: Path) -> None:
    task, executor = recipe(), slurm_executor(nodes=2, ntasks_per_node=2)
    with pytest.warns(SlurmPathWarning, match="log.log_dir='nemo_experiments' is relative: .*job's working directory"):
        check_layout(task, executor)
    task.log.explicit_log_dir = "runs/first"
    with pytest.warns(SlurmPathWarning, match="log.explicit_log_dir='runs/first' is relative: .*e.g. log.explicit"):
        check_layout(task, executor)
    with pytest.warns(SlurmPathWarning, match="job_dir 'jobs' is relative"):
        check_layout(run.Script(inline="hostname"), slurm_executor(job_dir="jobs"))

    task.log.explicit_log_dir = None
    task.log.log_dir = str(tmp_path / "runs")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlurmPathWarning)
        check_layout(task, executor)

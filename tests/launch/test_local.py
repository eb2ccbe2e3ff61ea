"""launch.local: `local_executor(...)` is an executor from Python and the `local` factory on the command line;
a recipe edited in Python runs and resumes through it (`run.Experiment` of two tasks)."""

import copy
import os
import sys
from pathlib import Path

import nemo_run as run
import pytest
from nemo_run.cli.api import RunContext

import recipes
from launch.local import local_executor
from nemo_ckpt.api import pretrain
from nemo_ckpt.checkpoint import AutoResume
from nemo_ckpt.checkpoint.context import load_model
from nemo_ckpt.checkpoint.manifest import Manifest


@pytest.fixture
def activated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's environment on PATH (`torchrun` found), as after `. .venv/bin/activate`."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def test_local_executor_from_python_is_an_executor(activated: None) -> None:
    executor = local_executor(ntasks_per_node=3, env_vars={"OMP_NUM_THREADS": "1"})

    assert isinstance(executor, run.LocalExecutor)
    assert (executor.ntasks_per_node, executor.launcher) == (3, "torchrun")
    assert executor.env_vars["OMP_NUM_THREADS"] == "1"


def test_local_factory_on_the_command_line_builds_the_same_executor(activated: None) -> None:
    context = RunContext(name="test")
    context.parse_args(["executor=local", "executor.ntasks_per_node=3"])

    assert isinstance(context.executor, run.LocalExecutor)
    assert (context.executor.ntasks_per_node, context.executor.launcher) == (3, "torchrun")
    with pytest.raises(ValueError, match="ntasks_per_node must be an integer >= 1, got 0"):
        RunContext(name="test").parse_args(["executor=local", "executor.ntasks_per_node=0"])


def test_invalid_settings_name_the_fix(activated: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ntasks_per_node must be an integer >= 1, got 0.*'BAD-NAME' is not a shell"):
        local_executor(ntasks_per_node=0, env_vars={"BAD-NAME": "1"})
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match=r"torchrun is not on PATH; activate .*\(`. .venv/bin/activate`\)"):
        local_executor()


@pytest.mark.parametrize(("factory", "devices"), [(recipes.tiny, 2), (recipes.small, 2), (recipes.llama3_8b, 8)])
def test_recipe_factories_from_python_are_recipes(factory, devices: int) -> None:
    recipe = factory()

    assert isinstance(recipe, run.Partial) and recipe.__fn_or_cls__ is pretrain
    assert (recipe.log.name, recipe.trainer.devices) == (factory.__name__, devices)


def steps(checkpoint_dir: Path) -> list[int]:
    return [record.step for record in Manifest.read(checkpoint_dir).complete()]


def test_experiment_pretrains_then_a_second_run_resumes_from_it(activated: None, tmp_path: Path) -> None:
    first = recipes.pretrain_recipe(name="first", dir=str(tmp_path), num_gpus_per_node=1, max_steps=4)
    first.model.config.num_layers = 1
    first.log.ckpt.every_n_train_steps = 2
    first.log.ckpt.save_top_k = -1
    second = copy.deepcopy(first)
    second.log.name = "second"
    second.trainer.max_steps = 6
    second.resume = run.Config(
        AutoResume, resume_if_exists=True, resume_from_directory=str(tmp_path / "first/checkpoints")
    )

    with run.Experiment("pretrain-resume", base_dir=str(tmp_path / "nemo_run"), log_level="WARN") as experiment:
        experiment.add(first, executor=local_executor(ntasks_per_node=1), name="first")
        experiment.add(second, executor=local_executor(ntasks_per_node=1), name="second")
        experiment.run(sequential=True)

    assert steps(tmp_path / "first" / "checkpoints") == [2, 4]
    assert steps(tmp_path / "second" / "checkpoints") == [6], "resumed at step 4: a fresh run would save 2 and 4"
    last = tmp_path / "second" / "checkpoints" / Manifest.read(tmp_path / "second" / "checkpoints").last
    assert load_model(last).config.num_layers == 1, "the edited recipe ran"

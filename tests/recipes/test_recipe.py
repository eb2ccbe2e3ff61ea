import os
import sys
from pathlib import Path

import fiddle as fdl
import lightning.pytorch as pl
import nemo_run as run
import pytest

from nemo_ckpt.api import pretrain
from nemo_ckpt.models import GPTModel
from nemo_ckpt.options import UnknownOptionError, UnsupportedOptionError
from nemo_ckpt.strategy import MegatronStrategy
from recipes import pretrain_recipe
from tests.helpers import commands


def test_recipe_is_an_editable_partial_of_pretrain(tmp_path):
    recipe = pretrain_recipe(name="edit", dir=str(tmp_path), num_gpus_per_node=1)
    assert isinstance(recipe, run.Partial) and recipe.__fn_or_cls__ is pretrain
    recipe.trainer.max_steps = 7
    recipe.trainer.strategy.ckpt_load_strictness = "raise_all"
    recipe.model.config.num_layers = 3

    built = fdl.build(recipe)
    assert built.func is pretrain
    trainer, model = built.keywords["trainer"], built.keywords["model"]
    assert isinstance(trainer, pl.Trainer) and trainer.max_steps == 7
    assert isinstance(trainer.strategy, MegatronStrategy)
    assert trainer.strategy.checkpoint_io.options.ckpt_load_strictness == "raise_all"
    assert isinstance(model, GPTModel) and model.config.num_layers == 3
    assert built.keywords["log"].checkpoint_dir == tmp_path / "edit" / "checkpoints"


def test_cli_dryrun_prints_resolved_config():
    activated = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # torchrun
    result = commands.nemo(
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny",
        "trainer.max_steps=33",
        "model.config.hidden_size=96",
        "run.executor=local",
        "run.executor.ntasks_per_node=2",
        "--dryrun",
        "--yes",
        env=activated,
    )
    assert result.returncode == 0, result.stdout
    out = "".join(result.stdout.split())
    assert "max_steps=33" in out and "hidden_size=96" in out and "strategy=MegatronStrategy(" in out
    assert "ddp=DistributedDataParallelConfig(" in out
    assert "LocalExecutor(" in out and "launcher='torchrun'" in out and "ntasks_per_node=2" in out


def test_an_option_set_from_python_is_refused_as_on_the_command_line():
    recipe = pretrain_recipe()
    with pytest.raises(UnsupportedOptionError, match=r"^MegatronStrategy: not supported: use_sharp \(NeMo meaning"):
        recipe.trainer.strategy.use_sharp = True
    with pytest.raises(UnknownOptionError, match=r"unknown option `ckpt_async_sav`; did you mean `ckpt_async_save`"):
        recipe.trainer.strategy.ckpt_async_sav = True
    with pytest.raises(UnknownOptionError, match=r"^ModelCheckpoint: unknown option `every_n_train_step`; did you"):
        recipe.log.ckpt.every_n_train_step = 5
    recipe.trainer.strategy.ckpt_async_save = True
    assert "StrictConfig" not in repr(recipe), "NeMo-Run shows the recipe's configs as run.Config"


def test_nemo_run_casts_the_recipe_s_configs_without_fiddle_s_warning(caplog):
    strategy = pretrain_recipe().trainer.strategy
    assert isinstance(fdl.cast(run.Config, strategy), run.Config) and not caplog.text

"""Strict options: unknown names get the closest declared one, NeMo options not implemented say what they mean,
for constructors and for command-line overrides of a recipe."""

import fiddle as fdl
import pytest

from nemo_ckpt.options import (
    UnknownOptionError,
    UnsupportedOptionError,
    check_config_options,
    check_override,
    strict_options,
)
from recipes import gpt


@strict_options({"old_name": "what it meant in NeMo"})
class Options:
    def __init__(self, learning_rate: float = 0.1, warmup_steps: int = 0) -> None:
        self.learning_rate = learning_rate


def test_constructor_names_the_closest_option_or_the_nemo_meaning():
    assert Options(learning_rate=0.5).learning_rate == 0.5
    with pytest.raises(
        UnknownOptionError, match=r"Options: unknown option `learnin_rate`; did you mean `learning_rate`\?"
    ):
        Options(learnin_rate=0.5)
    with pytest.raises(UnknownOptionError, match=r"unknown option `zzz`$"):
        Options(zzz=1)
    with pytest.raises(
        UnsupportedOptionError, match=r"not supported: old_name \(NeMo meaning: what it meant in NeMo\)"
    ):
        Options(old_name=1)
    with pytest.raises(AttributeError, match="learnin_rate"):  # Fiddle sees the declared signature
        fdl.Config(Options).learnin_rate = 0.5


def test_overrides_of_a_recipe_are_checked_against_their_target():
    recipe = gpt.tiny()
    with pytest.raises(
        UnknownOptionError, match=r"trainer.strategy: unknown option `ckpt_async_sav`; did you mean `ckpt_async_save`"
    ):
        check_override(recipe, "trainer.strategy.ckpt_async_sav")
    with pytest.raises(UnknownOptionError, match="did you mean `bucket_size`"):
        check_override(recipe, "trainer.strategy.ddp.bucket_sz")
    with pytest.raises(UnsupportedOptionError, match="not supported: ckpt_load_on_device"):
        check_override(recipe, "trainer.strategy.ckpt_load_on_device")
    check_override(recipe, "trainer.strategy.ckpt_async_save")
    check_override(recipe, "run.executor.account")  # not part of the task: left to its owner
    check_config_options(recipe)


def test_a_whole_config_is_checked_where_fiddle_cannot_see_names():
    def takes_anything(**kwargs):
        return kwargs

    config = fdl.Config(dict, inner=[fdl.Config(takes_anything, anything=1)])
    check_config_options(config)  # **kwargs: every name is declared
    config.inner.append(fdl.Config(Options))
    config.inner[1].__arguments__["warmup_stesp"] = 3  # as a deserialized config may hold it
    with pytest.raises(UnknownOptionError, match=r"config.inner\[1\]: unknown option `warmup_stesp`"):
        check_config_options(config)

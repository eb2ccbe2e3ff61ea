"""Strict options: unknown names get the closest declared one, NeMo options not implemented say what they mean,
for constructors and for command-line overrides of a recipe."""

import dataclasses
import inspect

import fiddle as fdl
import pytest

from nemo_ckpt.options import (
    UnknownOptionError,
    UnsupportedOptionError,
    check_config_options,
    check_override,
    flat_options,
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


@dataclasses.dataclass(frozen=True)
class SaveOptions:
    ckpt_async_save: bool = False
    ckpt_threads: int | None = None
    derived: int = dataclasses.field(default=0, init=False)


@strict_options()
@flat_options(SaveOptions)
class Saver:
    def __init__(self, *, name: str = "a", ckpt_threads: str = "own", **options: object) -> None:
        self.options = SaveOptions(**options)


def test_flat_options_are_declared_once_in_their_dataclass():
    parameters = inspect.signature(Saver).parameters
    assert list(parameters) == ["name", "ckpt_threads", "ckpt_async_save"]  # its own first; no init=False field
    assert parameters["ckpt_async_save"].default is False and parameters["ckpt_async_save"].annotation is bool
    assert Saver(ckpt_async_save=True).options.ckpt_async_save
    with pytest.raises(UnknownOptionError, match=r"unknown option `ckpt_async_sav`; did you mean `ckpt_async_save`"):
        Saver(ckpt_async_sav=True)
    with pytest.raises(AttributeError, match="ckpt_async_sav"):  # Fiddle sees the flat signature too
        fdl.Config(Saver).ckpt_async_sav = True
    assert fdl.build(fdl.Config(Saver, ckpt_async_save=True)).options.ckpt_async_save


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

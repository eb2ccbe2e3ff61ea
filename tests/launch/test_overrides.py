"""launch.overrides: lists and dicts on the command line arrive as Python lists and dicts where the option's type
allows one (`data.paths`), with or without quotes around the items; other values parse as before."""

import os

import pytest

from launch.cli import CheckedRunContext
from nemo_ckpt.api import pretrain
from nemo_ckpt.data.pretraining import PreTrainingDataModule
from tests.helpers import commands

BLEND = [0.3, "/data/web_text_document", 0.7, "/data/books_text_document"]


def paths(override: str) -> object:
    task = CheckedRunContext(name="test", factory="tiny(data=real)").parse_fn(pretrain, [override])
    assert task.data.__fn_or_cls__ is PreTrainingDataModule
    return task.data.paths


@pytest.mark.parametrize(
    "value",
    [
        "[0.3,/data/web_text_document,0.7,/data/books_text_document]",  # as typed, or after the shell ate the quotes
        "[0.3, /data/web_text_document, 0.7, /data/books_text_document]",
        "[0.3,'/data/web_text_document',0.7,'/data/books_text_document']",
        '"[0.3, "/data/web_text_document", 0.7, "/data/books_text_document"]"',
        "'[0.3, /data/web_text_document, 0.7, /data/books_text_document,]'",
    ],
)
def test_a_weighted_blend_is_a_list_with_float_weights(value: str) -> None:
    blend = paths(f"data.paths={value}")
    assert blend == BLEND and [type(item) for item in blend] == [float, str, float, str]


@pytest.mark.parametrize("value", ["['/a','/b']", "[/a,/b]", '["/a", "/b"]'])
def test_several_paths_are_a_list(value: str) -> None:
    assert paths(f"data.paths={value}") == ["/a", "/b"]


def test_one_path_a_dict_of_splits_and_a_quoted_number_keep_their_types() -> None:
    assert paths("data.paths=/data/web_text_document") == "/data/web_text_document"
    assert paths("data.paths={'train': ['/a'], 'validation': ['/b']}") == {"train": ["/a"], "validation": ["/b"]}
    assert paths("data.paths=['2024']") == ["2024"] and paths("data.paths=[2024]") == [2024]


def test_int_or_none_options_still_parse() -> None:
    task = CheckedRunContext(name="test", factory="tiny").parse_fn(
        pretrain, ["log.ckpt.every_n_train_steps=5", "log.ckpt.every_n_train_steps=None"]
    )
    assert task.log.ckpt.every_n_train_steps is None


def test_the_command_line_exports_the_blend_as_a_list(tmp_path) -> None:
    result = commands.nemo(
        "nemo_ckpt",
        "pretrain",
        "--factory",
        "tiny(data=real)",
        "data.paths=[0.3,/data/web_text_document,0.7,/data/books_text_document]",
        "--to-yaml",
        "recipe.yaml",
        cwd=tmp_path,
        env={**os.environ, "NEMORUN_HOME": str(tmp_path / "home")},
    )
    assert result.returncode == 0, result.stdout
    text = (tmp_path / "recipe.yaml").read_text()
    assert "- 0.3\n" in text and "- /data/web_text_document\n" in text and "- 0.7\n" in text, text

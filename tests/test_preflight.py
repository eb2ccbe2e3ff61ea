"""`check_task`: what a recipe would fail on minutes after launch is refused before it, named, in this process."""

import functools
import json
from pathlib import Path

import nemo_run as run
import pytest

from nemo_ckpt.checkpoint.layout import completion_marker
from nemo_ckpt.checkpoint.manifest import CheckpointRecord, Manifest
from nemo_ckpt.checkpoint.resume import AutoResume
from nemo_ckpt.preflight import PreflightError, check_task
from recipes import pretrain_recipe
from recipes.finetune import finetune_recipe


@pytest.fixture
def byte_level_data(tmp_path) -> str:
    from nemo_ckpt.data.preprocess import main as preprocess

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
    args = ["--input", str(corpus), "--tokenizer", "byte-level", "--output-prefix", str(tmp_path / "c"), "--append-eod"]
    assert preprocess(args) == 0
    return str(tmp_path / "c_text_document")


def fake_checkpoints(directory: Path, *records: CheckpointRecord) -> None:
    """A checkpoint directory whose manifest lists `records`, each with its completion marker."""
    manifest = Manifest()
    for record in records:
        completion_marker(directory / record.name).parent.mkdir(parents=True)
        completion_marker(directory / record.name).write_text("{}")
        manifest.add(record)
    manifest.write(directory)


def test_a_runnable_task_passes(tmp_path, byte_level_data):
    check_task(pretrain_recipe(dir=str(tmp_path)))
    check_task(pretrain_recipe(dir=str(tmp_path), data_paths=[byte_level_data], tokenizer="byte-level"))


def test_missing_paths_and_bad_tokenizers_are_named(tmp_path, byte_level_data):
    recipe = pretrain_recipe(dir=str(tmp_path), data_paths=[str(tmp_path / "nowhere")], tokenizer="byte-level")
    with pytest.raises(PreflightError, match=r"^data: Indexed dataset .*nowhere.idx does not exist"):
        check_task(recipe)
    recipe = pretrain_recipe(dir=str(tmp_path), data_paths=[byte_level_data], tokenizer=str(tmp_path / "no-tok"))
    with pytest.raises(PreflightError, match=r"^data: Tokenizer .*no-tok' does not exist"):
        check_task(recipe)
    recipe = pretrain_recipe(dir=str(tmp_path))
    recipe.resume.resume_from_path = str(tmp_path / "no-checkpoint")
    with pytest.raises(PreflightError, match=r"resume_from_path=.*no-checkpoint'\) is not a complete checkpoint"):
        check_task(recipe)
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "training.jsonl").write_text(json.dumps({"input": "a", "output": "b"}) + "\n")
    with pytest.raises(PreflightError, match=r"RestoreConfig\(path=.*no-model'\) is not a complete checkpoint"):
        check_task(finetune_recipe(restore_path=str(tmp_path / "no-model"), dataset_root=str(sft)))


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused_with_both_numbers(tmp_path, byte_level_data):
    recipe = pretrain_recipe(dir=str(tmp_path), data_paths=[byte_level_data], tokenizer="byte-level")
    recipe.model.config.vocab_size = 256
    with pytest.raises(PreflightError, match=r"vocab_size=256 is smaller than the 257 token ids of PreTrainingData"):
        check_task(recipe)


def test_checkpoint_directories_a_run_cannot_continue_are_refused_with_the_fix(tmp_path):
    recipe = pretrain_recipe(name="run", dir=str(tmp_path))
    directory = tmp_path / "run" / "checkpoints"
    fake_checkpoints(directory, CheckpointRecord("step=5", 5, 0, state="complete", weights_only=True))
    with pytest.raises(PreflightError, match=r"holds 1 checkpoints without optimizer state .*optimizer=False"):
        check_task(recipe)
    recipe.trainer.strategy.ckpt_load_optimizer = False
    check_task(recipe)
    recipe.trainer.strategy.ckpt_load_optimizer = True
    recipe.resume = run.Config(AutoResume, resume_if_exists=False)
    with pytest.raises(PreflightError, match=r"AutoResume\(resume_if_exists=False\): set resume.resume_if_exists=True"):
        check_task(recipe)


def test_finetune_without_restore_config_is_refused(tmp_path):
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "training.jsonl").write_text(json.dumps({"input": "a", "output": "b"}) + "\n")
    recipe = finetune_recipe(restore_path=str(tmp_path), dataset_root=str(sft))
    recipe.resume.restore_config = None
    with pytest.raises(PreflightError, match="finetune needs the weights to start from"):
        check_task(recipe)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("trainer.max_steps", -5, r"^trainer.max_steps=-5: use a positive number of steps \(or -1: no limit\)"),
        ("trainer.devices", 0, r"^trainer.devices=0: use 1 or more"),
        ("trainer.strategy.tensor_model_parallel_size", 3, r"^trainer.strategy: tensor_model_parallel_size=3 .*"),
        ("model.config.hidden_size", 0, r"^model: GPTConfig.hidden_size=0: use a positive integer"),
        ("data.micro_batch_size", 0, r"^data: MockDataModule\(micro_batch_size=0\): use 1 or more"),
    ],
)
def test_values_that_cannot_work_are_refused_with_their_key(tmp_path, key, value, message):
    recipe = pretrain_recipe(dir=str(tmp_path))
    *parents, name = key.split(".")
    setattr(functools.reduce(getattr, parents, recipe), name, value)
    with pytest.raises(PreflightError, match=message):
        check_task(recipe)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"trainer.strategy.pipeline_model_parallel_size": 2},
            r"^data.global_batch_size=4: The 1f1b pipeline schedule needs at least pipeline_model_parallel_size=2 .* "
            r"= 1 micro-batches",
        ),
        (
            {"data.global_batch_size": 6},
            r"^data.global_batch_size=6 must be a multiple of data.micro_batch_size x data-parallel size = 4 x 2",
        ),
    ],
)
def test_a_global_batch_the_layout_cannot_run_is_refused(tmp_path, settings, message):
    recipe = pretrain_recipe(dir=str(tmp_path), num_gpus_per_node=2)
    for key, value in settings.items():
        *parents, name = key.split(".")
        setattr(functools.reduce(getattr, parents, recipe), name, value)
    with pytest.raises(PreflightError, match=message):
        check_task(recipe)
    recipe.data.global_batch_size = 8
    check_task(recipe)

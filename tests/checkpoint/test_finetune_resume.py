"""A fine-tuning run (restored from an imported Hugging Face model) on 2 ranks, SIGKILLed mid-run and resumed, ends
bit-identical to an uninterrupted run. LoRA: its adapter checkpoints take the frozen base from the
restore path again on resume (full fine-tuning resumes like pretraining, `tests/checkpoint/test_train_resume.py`)."""

import csv

import pytest
import torch

pytest.importorskip("transformers")

from nemo_ckpt import dist_checkpointing  # noqa: E402
from nemo_ckpt.checkpoint.manifest import Manifest  # noqa: E402
from nemo_ckpt.logger.runs import version_dirs  # noqa: E402
from tests.checkpoint.finetune_run import RUN_NAME, imported_model_and_sft_set, run_finetune  # noqa: E402

MAX_STEPS = 6


def saved_steps(directory) -> dict[int, object]:
    checkpoint_dir = directory / RUN_NAME / "checkpoints"
    return {
        int(r.name.rsplit("step=", 1)[1]): checkpoint_dir / r.name for r in Manifest.read(checkpoint_dir).checkpoints
    }


def logged_losses(directory) -> dict[int, float]:
    """The training loss of each step, as the latest run (NeMoLogger version) logged it."""
    with open(version_dirs(directory / RUN_NAME)[-1] / "metrics.csv") as handle:
        return {
            int(r["step"]): float(r["reduced_train_loss"]) for r in csv.DictReader(handle) if r["reduced_train_loss"]
        }


def test_killed_lora_finetuning_resumes_bit_identically(tmp_path):
    peft_scheme = "lora"
    base, data = imported_model_and_sft_set(tmp_path)
    uninterrupted, crashed = tmp_path / "uninterrupted", tmp_path / "crashed"
    assert run_finetune(uninterrupted, base, data, peft_scheme, MAX_STEPS) == 0
    assert run_finetune(crashed, base, data, peft_scheme, MAX_STEPS, kill_at_step=5) != 0
    assert sorted(saved_steps(crashed)) == [2, 4]
    assert run_finetune(crashed, base, data, peft_scheme, MAX_STEPS) == 0

    reference = logged_losses(uninterrupted)
    resumed = logged_losses(crashed)
    assert sorted(resumed) == [4, 5], "the resumed run starts at the saved step 4"
    assert resumed == {step: reference[step] for step in (4, 5)}
    expected = dist_checkpointing.load_plain_tensors(saved_steps(uninterrupted)[MAX_STEPS] / "weights")
    actual = dist_checkpointing.load_plain_tensors(saved_steps(crashed)[MAX_STEPS] / "weights")
    assert expected.keys() == actual.keys()
    assert any(key.startswith("optimizer.state.exp_avg.") for key in expected)
    model_keys = [key for key in expected if not key.startswith("optimizer.")]
    assert model_keys and all(key.endswith((".lora_a", ".lora_b")) for key in model_keys)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key

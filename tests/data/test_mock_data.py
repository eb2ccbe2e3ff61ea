import warnings
from pathlib import Path

import torch

from nemo_ckpt.data.mock import ArithmeticSequences
from tests.helpers.distributed import run_distributed
from tests.helpers.trainer import fit


def test_samples_are_deterministic_and_shifted():
    dataset = ArithmeticSequences(num_samples=8, seq_length=16, vocab_size=256, seed=3)
    first, again = dataset[5], ArithmeticSequences(8, 16, 256, 3)[5]
    assert torch.equal(first["tokens"], again["tokens"])
    assert torch.equal(first["tokens"][1:], first["labels"][:-1])
    assert not torch.equal(dataset[4]["tokens"], first["tokens"])


def _warnings_of_a_mid_epoch_resume(rank: int, world_size: int, directory: Path) -> list[str]:
    fit(world_size, {}, 4, stop_at=2, save_to=directory / "step2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = fit(world_size, {}, 4, ckpt_path=directory / "step2")
    assert len(losses) == 2, "the resumed run trains steps 3 and 4 only"
    return [str(warning.message) for warning in caught]


def test_a_mid_epoch_resume_raises_no_not_resumable_warning(tmp_path):
    [messages] = run_distributed(_warnings_of_a_mid_epoch_resume, 1, tmp_path)
    assert not [message for message in messages if "not resumable" in message]

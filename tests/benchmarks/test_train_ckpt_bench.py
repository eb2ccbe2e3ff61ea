"""train_ckpt_bench's options are checked before any run: a checkpoint interval too short to measure, or no
checkpoints, repetitions or ranks, is an error that names the option (not a failure after minutes of training)."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def train_ckpt_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import train_ckpt_bench

    def no_run(*args):
        raise AssertionError("ran despite a bad option")

    monkeypatch.setattr(train_ckpt_bench, "run", no_run)
    return train_ckpt_bench


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--every", "4"], "--every 4: "),
        (["--every", "5", "--checkpoints", "0"], "--checkpoints 0: use 1 or more"),
        (["--reps", "0"], "--reps 0: use 1 or more"),
        (["--ranks", "0"], "--ranks 0: use 1 or more"),
    ],
)
def test_bad_options_fail_before_any_run(train_ckpt_bench, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["train_ckpt_bench.py", "--no-write", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train_ckpt_bench.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

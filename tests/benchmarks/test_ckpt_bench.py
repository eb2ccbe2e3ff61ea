"""ckpt_bench's options are checked before any run: no ranks or repetitions, a state smaller than one of its
tensors, or more ranks than GPUs with `--device cuda`, is an error that names the option (not a failure once every
contestant has run)."""

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def ckpt_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import ckpt_bench

    def no_run(*args, **kwargs):
        raise AssertionError("ran despite a bad option")

    monkeypatch.setattr(ckpt_bench, "check_dependencies", lambda *args, **kwargs: None)
    monkeypatch.setattr(ckpt_bench, "check_free_disk", no_run)
    monkeypatch.setattr(ckpt_bench, "run_config", no_run)
    return ckpt_bench


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "7", "0"], "--reps 7 0: use 1 or more"),
        (["--ranks", "0"], "--ranks 0: use 1 or more"),
        (["--sizes-gib", "1", "0.01"], "--sizes-gib 1.0 0.01: the state is made of 64 MiB tensors; use 0.0625"),
        (
            ["--device", "cuda", "--ranks", str(torch.cuda.device_count() + 1)],
            f"one GPU per rank, and this machine has {torch.cuda.device_count()}",
        ),
    ],
)
def test_bad_options_fail_before_any_run(ckpt_bench, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["ckpt_bench.py", "--no-write", *argv])
    with pytest.raises(SystemExit) as exit_info:
        ckpt_bench.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err

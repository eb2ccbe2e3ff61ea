"""train_ckpt_bench's options are checked before any run: a checkpoint interval too short to measure, or no
checkpoints, repetitions or ranks, is an error that names the option (not a failure after minutes of training);
more ranks than GPUs with `--device cuda` too; the report quotes the async rows' loss against that of the same bytes
written by `dd` in the background, the copy into new memory where it was measured, and a GPU run's device and
shape."""

import sys
from pathlib import Path

import pytest
import torch

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
        (["--micro-batch-size", "0"], "--micro-batch-size 0: use 1 or more"),
        (["--configs", "async, overlapped staging"], "differs from 'async' only with --device cuda"),
    ],
)
def test_bad_options_fail_before_any_run(train_ckpt_bench, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["train_ckpt_bench.py", "--no-write", *argv])
    with pytest.raises(SystemExit) as exit_info:
        train_ckpt_bench.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def run(train: float, **extra: float) -> dict:
    return {"train": train, "steps": [1.0] * 12, "peak": 0, "state_bytes": 1 << 30, "copy": 0.25,
            "commits": [1.0, 1.0], "checkpoints": 2, "stolen": None, **extra}  # fmt: skip


def test_report_quotes_async_against_the_background_dd_write(train_ckpt_bench):
    measured = {
        "no checkpoint": [run(100.0)],
        "async": [run(101.0)],
        train_ckpt_bench.BACKGROUND_WRITE: [run(102.0)],
    }
    text = train_ckpt_bench.report(measured, ranks=2, every=5, checkpoints=2, reps=1, note="")
    assert "lose 1.00 s per write; lost per checkpoint against it: async 0.50x." in text
    assert "| async | 1.000 | 1.000 | 0.50 | 2.00 |" in text


def test_report_quotes_the_copy_into_new_memory_where_measured(train_ckpt_bench):
    measured = {"no checkpoint": [run(100.0, copy_new=0.5)], "async": [run(101.0, copy_new=0.7)]}
    text = train_ckpt_bench.report(measured, ranks=2, every=5, checkpoints=2, reps=1, note="")
    assert "takes 0.250 s per rank, into new memory 0.600 s (what faulting memory in costs" in text
    old = {"no checkpoint": [run(100.0)], "async": [run(101.0)]}  # raw results of runs before it was measured
    text = train_ckpt_bench.report(old, ranks=2, every=5, checkpoints=2, reps=1, note="")
    assert "takes 0.250 s per rank; the no-checkpoint run's median step is 1.000 s" in text


def test_report_of_one_checkpoint_per_run_leaves_the_later_checkpoints_blank(train_ckpt_bench):
    def one(train: float) -> dict:
        return {**run(train), "steps": [1.0] * 7, "commits": [1.0], "checkpoints": 1}

    text = train_ckpt_bench.report({"no checkpoint": [one(100.0)], "async": [one(101.0)]}, 2, 5, 1, 1, "")
    assert "| async | 1.000 | 1.000 | 1.00 | 4.00 | 2.0% | 0.00 | 0.00 |  |  | 1.00 |" in text


def test_more_ranks_than_gpus_fail_before_any_run(train_ckpt_bench, monkeypatch, capsys):
    ranks = torch.cuda.device_count() + 1
    monkeypatch.setattr(sys, "argv", ["train_ckpt_bench.py", "--no-write", "--device", "cuda", "--ranks", str(ranks)])
    with pytest.raises(SystemExit):
        train_ckpt_bench.main()
    assert f"--device cuda --ranks {ranks}: one GPU per rank" in capsys.readouterr().err


def test_report_of_a_gpu_run_names_its_device_and_shape(train_ckpt_bench):
    measured = {"no checkpoint": [run(100.0)], "async": [run(101.0)]}
    text = train_ckpt_bench.report(measured, 1, 5, 2, 1, "", micro_batch_size=4, device="cuda")
    assert "--device cuda --seq-length" in text
    assert "1 NCCL ranks on as many GPUs" in text
    assert "micro-batch 4 x" in text

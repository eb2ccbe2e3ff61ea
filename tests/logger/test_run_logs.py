"""The README's set-up command, as a user runs it (the block itself, `tests/helpers/snippets.py`, run once per session
with its documentation test): the tiny recipe through `nemo ... run.executor=local` (torchrun, 2 ranks) for 20 steps,
then resumed to 30: the console, the TensorBoard events and CSVs of both versions, the `runs` and `plot` commands on
them."""

import csv
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from nemo_ckpt.logger.cli import main as logger_cli
from nemo_ckpt.logger.flops import training_flops_per_token
from nemo_ckpt.logger.runs import version_dirs
from nemo_ckpt.models import gpt_config
from tests.helpers.snippets import SNIPPETS, run_once

SET_UP = "pretrain --factory tiny trainer.max_steps=20 run.executor=local --yes && nemo nemo_ckpt pretrain"
GLOBAL_BATCH_SIZE = 8  # the tiny recipe: micro-batch 4 on each of 2 ranks
TOKENS_PER_STEP = GLOBAL_BATCH_SIZE * 32
RUN_HEADER = "Dry run for task nemo_ckpt.api:pretrain"  # what NeMo-Run prints as each `nemo ... --yes` starts


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[str]]:
    """`nemo_experiments/tiny` after the README's set-up command (checkpoints every 10 steps) and the console output
    of its two runs (to step 20, then 30)."""
    [set_up] = [snippet for snippet in SNIPPETS if SET_UP in snippet.code]
    directory, result = run_once(set_up, tmp_path_factory.mktemp)
    assert result.returncode == 0, result.stdout[-5000:]
    _, *outputs = result.stdout.split(RUN_HEADER)
    assert len(outputs) == 2, f"two runs: {result.stdout[-5000:]}"
    return directory / "nemo_experiments" / "tiny", outputs


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def iterations(output: str) -> list[str]:
    return re.findall(r"iteration \d+/\d+ \|[^\n]*", output)


def test_console_shows_every_step_the_resume_point_and_no_noise(runs):
    run_dir, (first, second) = runs
    lines = iterations(first)
    assert [line.split(" | ")[0] for line in lines] == [f"iteration {step}/20" for step in range(1, 21)]
    number = r"[\d.e+-]+"
    for step, line in enumerate(lines, start=1):
        assert re.fullmatch(
            rf"iteration {step}/20 \| consumed_samples {step * GLOBAL_BATCH_SIZE} \| lr {number} \| "
            rf"reduced_train_loss {number} \| grad_norm {number} \| step_time {number}s \| tokens/s \d+ \| "
            rf"TFLOP/s/device {number} \| MFU n/a \| mem {number} GiB \(peak RSS\)",
            line,
        ), line
    assert re.search(r"validation at iteration 10 \| val_loss [\d.]+", first)
    for step in (10, 20):
        assert re.search(rf"checkpoint of step {step}: blocked training [\d.]+s, size [\d.]+ MiB", first), step
    notices = ("GPU available", "💡 Tip", "torch/distributed/launcher/api.py", "Setting OMP_NUM_THREADS environment")
    for noise in notices:
        assert noise not in first, noise

    name = next(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith("step=20"))
    checkpoint = Path("nemo_experiments", "tiny", "checkpoints", name)  # the recipe's log_dir, relative
    assert f"resuming from {checkpoint} at step 20, consumed_samples 160" in second
    assert [line.split(" | ")[0] for line in iterations(second)] == [f"iteration {s}/30" for s in range(21, 31)]


def test_tensorboard_events_of_both_versions_hold_steps_0_to_29_and_the_first_csv_is_kept(runs):
    run_dir, _ = runs
    first, second = version_dirs(run_dir)
    steps = {}
    for version in (first, second):
        events = EventAccumulator(str(version), size_guidance={SCALARS: 0})
        events.Reload()
        steps[version] = [event.step for event in events.Scalars("reduced_train_loss")]
    assert steps[first] == list(range(20)) and steps[second] == list(range(20, 30))

    rows = [row for row in csv_rows(first / "metrics.csv") if row["reduced_train_loss"]]
    assert [int(row["step"]) for row in rows] == list(range(20)), "the resumed runs did not touch it"
    flops_per_step = training_flops_per_token(gpt_config("tiny")) * TOKENS_PER_STEP
    for row in rows:  # the throughput figures are the hand-countable work over the measured time
        step_time = float(row["step_time"])
        assert float(row["tokens_per_sec"]) * step_time == pytest.approx(TOKENS_PER_STEP, rel=1e-6)
        assert float(row["tflops_per_device"]) * 1e12 * step_time * 2 == pytest.approx(flops_per_step, rel=1e-6)
        assert row.get("mfu", "") == "", "no MFU on CPU without a peak"
    saves = [row for row in csv_rows(first / "metrics.csv") if row.get("checkpoint_blocking_time")]
    assert [int(row["step"]) for row in saves] == [9, 19], "the saves of iterations 10 and 20, where their loss is"
    assert all(float(row["checkpoint_size"]) > 0 for row in saves)
    for version in (first, second):
        assert (version / "nemo_log_globalrank-0_localrank-0.txt").is_file()
        assert (version / "nemo_log_globalrank-1_localrank-1.txt").is_file(), "rank 1 found rank 0's version"
        assert (version / "config.yaml").is_file()


def test_plot_joins_the_versions_into_one_curve(runs, tmp_path, capsys):
    run_dir, _ = runs
    out = tmp_path / "curves.png"
    assert logger_cli(["plot", str(run_dir), "--metrics", "reduced_train_loss,val_loss,lr", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "reduced_train_loss: 30 points, steps 0-29" in printed and f"wrote {out}" in printed
    assert "val_loss: 3 points, steps 9-29" in printed, "validation every 10 steps"


def test_runs_lists_versions_last_step_and_checkpoint(runs, capsys):
    run_dir, _ = runs
    assert logger_cli(["runs", str(run_dir.parent)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        rf"tiny \({run_dir}\): 2 version\(s\), last logged step 29, last checkpoint \S+step=30", printed[0]
    ), printed[0]
    assert [line.split(": ")[1] for line in printed[1:]] == ["steps 0-19", "steps 20-29"]

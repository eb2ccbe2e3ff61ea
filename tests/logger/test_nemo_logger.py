"""`NeMoLogger` on a single-process Trainer: directories and versions, loggers kept and added, the per-step metrics
and the progress line (plain and on a terminal)."""

import fcntl
import io
import os
import pty
import re
import struct
import termios
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from nemo_ckpt.logger import NeMoLogger, ProgressPrinter, StepMetrics
from nemo_ckpt.logger.flops import training_flops_per_token
from nemo_ckpt.logger.runs import read_scalars, version_dirs
from nemo_ckpt.logger.text_log import TextLog
from nemo_ckpt.models import gpt_config
from tests.logger.tiny import GLOBAL_BATCH_SIZE, MAX_STEPS, fit, trainer


def test_user_logger_is_kept_and_gets_the_same_metrics(tmp_path, capsys):
    user_logger = CSVLogger(tmp_path / "mine", name="user", version="v")
    run = trainer(logger=user_logger)
    log = NeMoLogger(name="exp", log_dir=str(tmp_path / "logs"), peak_tflops_per_device=1.0)
    run_dir = log.setup(run, task_config={"seed": 1, "model": gpt_config("tiny")})

    assert run.loggers[0] is user_logger, "the user's logger stays first"
    assert {type(logger) for logger in run.loggers[1:]} == {CSVLogger, TensorBoardLogger}
    assert run_dir.parent == tmp_path / "logs" / "exp" and re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run_dir.name)
    assert user_logger.log_dir == str(run_dir / "user" / "v"), "update_logger_directory moves it into the run"
    fit(run)

    ours = read_scalars(run_dir)  # TensorBoard events
    with open(run_dir / "user" / "v" / "metrics.csv") as handle:
        header = handle.readline().strip().split(",")
    expected = {"reduced_train_loss", "lr", "grad_norm", "step_time", "tokens_per_sec", "tflops_per_device", "mfu"}
    assert expected | {"memory"} <= set(ours) and expected | {"memory"} <= set(header)
    assert sorted(ours["reduced_train_loss"]) == list(range(MAX_STEPS))
    tokens = GLOBAL_BATCH_SIZE * 32
    for step in range(MAX_STEPS):
        step_time = ours["step_time"][step]
        assert ours["tokens_per_sec"][step] * step_time == pytest.approx(tokens, rel=1e-5)
        flops = ours["tflops_per_device"][step] * 1e12 * step_time
        assert flops == pytest.approx(training_flops_per_token(gpt_config("tiny")) * tokens, rel=1e-5)
        assert ours["mfu"][step] == pytest.approx(ours["tflops_per_device"][step] / 1.0, rel=1e-5)

    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("iteration ")]
    assert [line.split(" | ")[0] for line in lines] == [f"iteration {i}/{MAX_STEPS}" for i in range(1, MAX_STEPS + 1)]
    assert re.search(r"consumed_samples 8 \| lr \S+ \| reduced_train_loss [\d.]+ \| grad_norm [\d.]+ \| ", lines[1])
    assert re.search(r"step_time [\d.]+s \| tokens/s \d+ \| TFLOP/s/device [\d.e-]+ \| MFU [\d.]+% \| mem ", lines[1])
    assert "GPU available" not in out

    text_log = (run_dir / "nemo_log_globalrank-0_localrank-0.txt").read_text()
    assert lines[-1] in text_log
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["seed"] == 1 and config["model"]["hidden_size"] == 64
    assert config["model"]["_target_"] == "nemo_ckpt.models.gpt.model.GPTConfig"
    for hparams in (run_dir / "hparams.yaml", run_dir / "user" / "v" / "hparams.yaml"):  # TensorBoard's, CSV's
        assert yaml.safe_load(hparams.read_text()) == config


def setup_only(log: NeMoLogger) -> Path:
    """`log.setup` on a fresh Trainer that will not train: its text log closed again."""
    run = trainer()
    run_dir = log.setup(run)
    for callback in run.callbacks:
        if isinstance(callback, TextLog):
            callback.close()
    return run_dir


def test_every_run_gets_a_new_version_and_nothing_is_overwritten(tmp_path):
    for expected in ("version_0", "version_1"):
        log = NeMoLogger(name="exp", log_dir=str(tmp_path), use_datetime_version=False, tensorboard=False)
        assert setup_only(log) == tmp_path / "exp" / expected
    first = setup_only(NeMoLogger(name="exp", log_dir=str(tmp_path)))
    second = setup_only(NeMoLogger(name="exp", log_dir=str(tmp_path)))
    assert first != second and first.parent == second.parent, "two runs within a second: two versions"
    assert (first / "nemo_log_globalrank-0_localrank-0.txt").is_file() and (first / "cmd-args.log").is_file()
    assert setup_only(NeMoLogger(name="exp", log_dir=str(tmp_path), version="mine")) == tmp_path / "exp" / "mine"
    assert NeMoLogger(name="exp", log_dir=str(tmp_path)).checkpoint_dir == tmp_path / "exp" / "checkpoints"


def test_explicit_log_dir_reused_keeps_the_first_csv(tmp_path):
    explicit = tmp_path / "here"
    first = trainer(max_steps=2)
    log = NeMoLogger(explicit_log_dir=str(explicit), tensorboard=False)
    assert log.setup(first) == explicit and log.checkpoint_dir == explicit / "checkpoints"
    fit(first)
    before = (explicit / "metrics.csv").read_text()

    second = trainer(max_steps=2)
    NeMoLogger(explicit_log_dir=str(explicit), tensorboard=False).setup(second)
    fit(second)
    assert (explicit / "metrics.csv").read_text() == before
    assert (explicit / "metrics_1" / "metrics.csv").is_file()
    assert version_dirs(explicit) == [explicit]


def test_progress_bar_on_a_terminal(tmp_path):
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # 24 rows, 160 columns
    with os.fdopen(terminal, "w") as stream:
        step_metrics = StepMetrics()
        run = trainer(callbacks=[step_metrics, ProgressPrinter(step_metrics, stream)])
        fit(run)
    os.set_blocking(controller, False)
    shown = os.read(controller, 1 << 16).decode()
    os.close(controller)
    assert "training" in shown and f"{MAX_STEPS}/{MAX_STEPS}" in shown, "a tqdm bar"
    assert f"iteration {MAX_STEPS}/{MAX_STEPS} | " in shown, "lines are printed above the bar"


def test_plain_lines_and_log_interval(tmp_path):
    stream = io.StringIO()
    step_metrics = StepMetrics()
    fit(trainer(max_steps=5, log_every_n_steps=2, callbacks=[step_metrics, ProgressPrinter(step_metrics, stream)]))
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["iteration 2/5", "iteration 4/5", "iteration 5/5"]
    assert "\r" not in stream.getvalue() and "MFU n/a" in lines[0], "no bar, no MFU without a peak on CPU"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "a/b"}, "name"),
        ({"version": ""}, "version"),
        ({"tensorboard": "yes"}, "tensorboard"),
        ({"peak_tflops_per_device": 0}, "peak_tflops_per_device"),
        ({"tensorbord": False}, "unknown option `tensorbord`; did you mean `tensorboard`"),
        ({"files_to_copy": ["a.yaml"]}, r"not supported: files_to_copy \(NeMo meaning: files copied"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        NeMoLogger(**kwargs)

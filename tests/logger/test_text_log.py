"""The quiet console (Lightning's start-up notices filtered, torchrun's agent at WARNING) and its opt-outs."""

import io
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launch.local import local_executor
from nemo_ckpt.logger.text_log import launcher_env, quiet_console, slurm_attempt_line, verbose_requested


@pytest.fixture
def lightning_console():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logging.getLogger("lightning.pytorch").addHandler(handler)
    yield logger, stream
    logging.getLogger("lightning.pytorch").removeHandler(handler)
    quiet_console(not verbose_requested())


def test_start_up_notices_are_filtered_unless_verbose(lightning_console):
    logger, stream = lightning_console
    quiet_console(True)
    logger.info("GPU available: False, used: False")
    logger.info("`Trainer.fit` stopped: `max_steps=20` reached.")
    assert stream.getvalue() == "`Trainer.fit` stopped: `max_steps=20` reached.\n"
    quiet_console(False)
    logger.info("GPU available: False, used: False")
    assert stream.getvalue().endswith("GPU available: False, used: False\n")


def test_torchrun_is_quiet_unless_the_shell_asks(monkeypatch):
    monkeypatch.delenv("LOGLEVEL", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launcher_env() == {"LOGLEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    assert not verbose_requested()
    monkeypatch.setenv("LOGLEVEL", "INFO")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # torchrun
    assert launcher_env()["LOGLEVEL"] == "INFO" and verbose_requested()
    executor = local_executor(env_vars={"OMP_NUM_THREADS": "4"})
    assert executor.env_vars == {"LOGLEVEL": "INFO", "OMP_NUM_THREADS": "4"}, "the user's env vars win"


def test_warnings_still_reach_the_console_while_the_text_log_is_open(tmp_path):
    script = (
        "import logging, sys; from nemo_ckpt.logger.text_log import TextLog; log = TextLog(sys.argv[1]); log.open(); "
        "logging.getLogger('nemo_ckpt.checkpoint.preemption').warning('Received SIGUSR1: saved step 3'); log.close()"
    )  # in a fresh process: pytest's own logging handlers would hide what a training process prints
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Received SIGUSR1: saved step 3" in result.stderr
    [text_log] = tmp_path.glob("nemo_log_globalrank-0_*.txt")
    assert "Received SIGUSR1: saved step 3" in text_log.read_text()


def test_first_process_of_each_node_marks_the_slurm_attempt(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm_attempt_line() is None, "not a Slurm job"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert slurm_attempt_line() == f"Slurm job 42: attempt 1 on {socket.gethostname()}"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert slurm_attempt_line() == f"Slurm job 42: attempt 3 on {socket.gethostname()}"
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert slurm_attempt_line() is None, "one line per node"

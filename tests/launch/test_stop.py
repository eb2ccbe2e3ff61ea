"""Stopping a local run from the `nemo` command (the real command, as a terminal's Ctrl-C or a `kill` reaches it):
the ranks save a checkpoint at the end of their step and stop, a second signal kills them, and no process of the run
outlives the command, even once its torchrun is gone. Each process of the run is found by a variable of the test in
its environment (inherited from `nemo`), whatever became of its parent."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from nemo_ckpt.checkpoint.manifest import Manifest
from tests.helpers import commands

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the run's processes through /proc")

TIMEOUT_S = 600
MARK = "NEMO_CKPT_TEST_RUN"
CHECKPOINTS = Path("nemo_experiments/tiny/checkpoints")


def wait_for(condition: Callable[[], object], what: str, timeout: float = TIMEOUT_S) -> object:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def environment(tmp_path: Path, run_id: str) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "NEMORUN_HOME": str(tmp_path / "home"), "PATH": path, MARK: run_id}


class Nemo:
    """`nemo nemo_ckpt pretrain --factory tiny ... run.executor=local --yes` training for a long time, its output
    (stdout and stderr together) collected line by line."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.run_id = uuid.uuid4().hex
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "nemo"),
                *("nemo_ckpt", "pretrain", "--factory", "tiny", "trainer.max_steps=100000"),
                *("log.ckpt.every_n_train_steps=100000", "run.executor=local", "--yes"),
            ],
            cwd=tmp_path,
            env=environment(tmp_path, self.run_id) | env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, pattern: str) -> re.Match:
        return wait_for(lambda: re.search(pattern, self.output, re.M), f"{pattern!r} in the output")

    def run_processes(self) -> dict[int, str]:
        """The run's processes other than `nemo`: pid -> command line."""
        entry = f"{MARK}={self.run_id}".encode()
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if int(pid) != self.process.pid and entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
        return found

    def finish(self) -> int:
        """`nemo`'s exit status, once it and every process of the run are gone."""
        status = self.process.wait(TIMEOUT_S)
        self._reader.join(TIMEOUT_S)
        wait_for(lambda: not self.run_processes(), "the run's processes to be gone")
        return status

    def kill(self) -> None:
        for pid in [*self.run_processes(), self.process.pid]:
            os.kill(pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def nemo(tmp_path: Path):
    """`Nemo` in tmp_path; torchrun would kill ranks that do not stop after 600 s (its default: 30 s)."""
    started = Nemo(tmp_path, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="600")
    yield started
    if started.process.poll() is None or started.run_processes():
        started.kill()


def steps(tmp_path: Path) -> list[int]:
    return [record.step for record in Manifest.read(tmp_path / CHECKPOINTS).complete()]


def test_sigterm_checkpoints_stops_every_rank_and_a_rerun_resumes(nemo: Nemo, tmp_path: Path) -> None:
    nemo.wait_for_line(r"iteration 2/100000")
    nemo.process.send_signal(signal.SIGTERM)

    assert nemo.finish() == 128 + signal.SIGTERM, nemo.output
    step = int(re.search(r"Received SIGTERM: saved \S+ at step (\d+); stopping", nemo.output)[1])
    assert step >= 2 and steps(tmp_path) == [step], "the stop's checkpoint, the only one"
    assert "error: pretrain stopped by SIGTERM" in nemo.output and "killed" not in nemo.output

    rerun = commands.nemo(
        *("nemo_ckpt", "pretrain", "--factory", "tiny", f"trainer.max_steps={step + 1}", "run.executor=local"),
        "--yes",
        cwd=tmp_path,
        env=environment(tmp_path, uuid.uuid4().hex),
    )
    assert rerun.returncode == 0, rerun.stdout
    assert re.search(rf"resuming from \S+step={step}\S* at step {step}\b", rerun.stdout), rerun.stdout
    assert steps(tmp_path)[-1] == step + 1


def test_ctrl_c_twice_kills_ranks_that_do_not_stop(nemo: Nemo) -> None:
    """A rank that cannot stop (here: SIGSTOPped) holds the others in a collective, and torchrun waits for it; the
    second Ctrl-C kills them all."""
    nemo.wait_for_line(r"iteration 2/100000")
    ranks = [
        pid for pid, command in nemo.run_processes().items() if "fdl_runner" in command and "torchrun" not in command
    ]
    assert len(ranks) == 2, nemo.run_processes()
    os.kill(ranks[1], signal.SIGSTOP)

    nemo.process.send_signal(signal.SIGINT)
    nemo.wait_for_line(r"^nemo_ckpt: SIGINT: stopping the run")
    nemo.process.send_signal(signal.SIGINT)

    assert nemo.finish() == 128 + signal.SIGINT, nemo.output
    assert re.search(r"^nemo_ckpt: SIGINT again: killed the run's \d+ processes", nemo.output, re.M), nemo.output


def test_ranks_orphaned_by_a_dead_torchrun_do_not_outlive_the_command(nemo: Nemo) -> None:
    """The ranks are SIGSTOPped first, so that only `nemo` can end them once torchrun is gone."""
    nemo.wait_for_line(r"iteration 2/100000")
    processes = nemo.run_processes()
    [torchrun] = [pid for pid, command in processes.items() if "bin/torchrun" in command]
    ranks = [pid for pid, command in processes.items() if "fdl_runner" in command and "torchrun" not in command]
    for rank in ranks:
        os.kill(rank, signal.SIGSTOP)
    os.kill(torchrun, signal.SIGKILL)

    assert nemo.finish() == 1, nemo.output
    assert re.search(r"^nemo_ckpt: killed 2 process\(es\) the run left behind", nemo.output, re.M), nemo.output
    assert re.search(r"^error: pretrain FAILED; its log: nemo experiment logs \S+ 0$", nemo.output, re.M)

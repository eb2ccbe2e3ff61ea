"""launch.processes: a run's processes are found by the variable they inherit, also once orphaned."""

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest

from launch.processes import RUN_ID, run_processes, run_roots, signal_all

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc")

PARENT_OF_A_SLEEPER = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"


def wait_for(condition: Callable[[], object], what: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


def test_roots_then_orphans_are_found_and_killed() -> None:
    run_id = uuid.uuid4().hex
    parent = subprocess.Popen([sys.executable, "-c", PARENT_OF_A_SLEEPER], env={**os.environ, RUN_ID: run_id})
    try:
        pids = wait_for(lambda: len(run_processes(run_id)) == 2 and run_processes(run_id), "parent and child")
        assert parent.pid in pids and run_roots(run_id) == [parent.pid]
        assert run_processes(uuid.uuid4().hex) == [], "another run's id finds nothing"

        parent.kill()
        parent.wait()
        [child] = wait_for(lambda: run_processes(run_id), "the orphan")
        assert child != parent.pid and run_roots(run_id) == [child], "an orphan is a root"

        assert signal_all([child, parent.pid], signal.SIGKILL) == [child]
        wait_for(lambda: not run_processes(run_id), "the orphan's end")
    finally:
        signal_all(run_processes(run_id), signal.SIGKILL)
        parent.kill()
        parent.wait()

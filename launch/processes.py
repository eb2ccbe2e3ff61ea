"""The processes of one local run, found by an environment variable they all inherit (Linux `/proc`).

torchrun, its worker ranks and what those start (data loader workers, checkpoint writer processes) each lead their
own session, so neither a terminal's Ctrl-C nor a signal to a process group reaches all of them; a rank whose torchrun
died is no longer anyone's child. What they do share is the environment: the local executor gives torchrun
`NEMO_CKPT_RUN_ID=<id>`, which every descendant inherits, whatever became of its parent.
"""

import os
import signal
from pathlib import Path

RUN_ID = "NEMO_CKPT_RUN_ID"
_PROC = Path("/proc")


def _environment_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in (_PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def _parent(pid: int) -> int | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"; comm may hold spaces and ')'


def run_processes(run_id: str, variable: str = RUN_ID) -> list[int]:
    """The live processes whose environment has `variable=run_id` (none where there is no `/proc`)."""
    entry = f"{variable}={run_id}".encode()
    pids = [int(path.name) for path in _PROC.glob("[0-9]*")] if _PROC.is_dir() else []
    return [pid for pid in pids if pid != os.getpid() and _environment_has(pid, entry)]


def run_roots(run_id: str) -> list[int]:
    """The processes of the run whose parent is not one of them: torchrun, and any rank that outlived it."""
    pids = run_processes(run_id)
    return [pid for pid in pids if _parent(pid) not in pids]


def signal_all(pids: list[int], signum: signal.Signals) -> list[int]:
    """Send `signum` to each of `pids`; the ones that were still there."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
        sent.append(pid)
    return sent

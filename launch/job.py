"""Run a task as `nemo nemo_ckpt pretrain|finetune ...` does, and say how it ended in the command's exit status.

NeMo-Run's `run.run` waits for the job, logs `Job <id> finished: FAILED` and returns nothing, so the command exited
0 whatever the job did; and a local job's torchrun and ranks each lead their own session, so Ctrl-C (or SIGTERM) to
`nemo` killed `nemo` alone and left the run training. `run_and_wait` runs the same NeMo-Run experiment, then returns:

* 0: the job succeeded (or a Slurm job was submitted with `--detach`);
* 1: it failed or was cancelled, or its end is unknown (e.g. Slurm without accounting), with `error: ...` on stderr;
* 128 + N: a local run stopped on signal N to `nemo` (130: Ctrl-C, 143: SIGTERM).

A local run is stopped by the first SIGINT, SIGTERM or SIGHUP to `nemo`: torchrun gets SIGTERM and forwards it to
every rank, whose `PreemptionCallback` saves a checkpoint at the end of the current step and stops; torchrun kills
ranks still running after `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (default 30; an executor env var). A second
signal kills every process of the run at once. Whatever the ending, no process of the run outlives the command
(`launch.processes`). `nemo experiment cancel` cannot stop a local run: NeMo-Run's local scheduler cancels only jobs
its own process started.
"""

import os
import signal
import sys
import threading
import uuid
from contextlib import nullcontext
from types import FrameType, TracebackType
from typing import Any

import nemo_run as run
from torchx.specs import AppState

from launch.processes import RUN_ID, run_processes, run_roots, signal_all
from nemo_ckpt._compat import nemo_run_experiment_dir

FAILED = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_WAITING = (AppState.SUBMITTED, AppState.PENDING, AppState.RUNNING)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _say_in_handler(message: str) -> None:
    """`_say` for a signal handler: unbuffered, so it cannot re-enter a write to `sys.stderr` it interrupted."""
    os.write(2, f"{message}\n".encode())


class StopOnSignals:
    """While a local run (the processes with `NEMO_CKPT_RUN_ID=run_id`) is launched and waited for: the first
    SIGINT/SIGTERM/SIGHUP sends SIGTERM to its torchrun (and to any rank that outlived it), the second SIGKILL to all
    its processes; on leaving, processes of the run still alive are killed."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.received: signal.Signals | None = None
        self._stopped: set[int] = set()
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> "StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            killed = signal_all(run_processes(self.run_id), signal.SIGKILL)
            _say_in_handler(f"nemo_ckpt: {signal.Signals(signum).name} again: killed the run's {len(killed)} processes")
            return
        self.received = signal.Signals(signum)
        _say_in_handler(
            f"nemo_ckpt: {self.received.name}: stopping the run; its ranks save a checkpoint at the end of their "
            "step, then exit (Ctrl-C again kills them now)"
        )
        self.stop()

    def stop(self) -> None:
        """After a signal: ask the run's torchrun, and any rank that outlived it, to stop (once each)."""
        if self.received is None:
            return
        roots = [pid for pid in run_roots(self.run_id) if pid not in self._stopped]
        self._stopped.update(signal_all(roots, signal.SIGTERM))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        left = signal_all(run_processes(self.run_id), signal.SIGKILL)
        if left:
            _say(f"nemo_ckpt: killed {len(left)} process(es) the run left behind: {left}")


def run_and_wait(
    task: run.Partial, executor: run.Executor, name: str, plugins: list[run.Plugin], detach: bool = False
) -> int:
    """Run `task` on `executor` as NeMo-Run's `run.run` does (an experiment of one job, its log tailed); the exit
    status for the command (module docstring)."""
    local = isinstance(executor, run.LocalExecutor)
    run_id = uuid.uuid4().hex
    if local:
        executor.env_vars[RUN_ID] = run_id
    stopper = StopOnSignals(run_id) if local else None
    with stopper or nullcontext():
        with run.Experiment(name, executor=executor, log_level="INFO") as experiment:
            if stopper is None or stopper.received is None:
                experiment.add(task, name=name, plugins=plugins, tail_logs=True)
                if local:
                    _say(f"nemo_ckpt: Ctrl-C or `kill {os.getpid()}` stops the run (after a checkpoint)")
                experiment.run(detach=detach)
                if stopper is not None:
                    stopper.stop()  # a signal that came while torchrun was being started
    if stopper is not None and stopper.received is not None:
        _say(f"error: {name} stopped by {stopper.received.name}")
        return 128 + stopper.received
    state = experiment.jobs[0].state
    if state == AppState.SUCCEEDED or (detach and state in _WAITING):
        return 0
    experiment_id = nemo_run_experiment_dir(experiment).name
    _say(f"error: {name} {state.name}; its log: nemo experiment logs {experiment_id} 0")
    return FAILED

"""`nemo ARGS` and `python SCRIPT` as a fresh process runs them, in a child of the session's forkserver
(`tests.helpers.distributed`), whose server imported torch, Lightning and NeMo-Run once: without the 10-15 s a fresh
interpreter spends importing them.

The child takes the command's environment, working directory and `sys.argv` first, and NeMo-Run's home from the
environment's `NEMORUN_HOME` (NeMo-Run reads it once, at import, also into its job registries); its stdin is
/dev/null, its stdout and stderr go together into the result's `stdout`. What the command starts (torchrun,
sbatch) are real processes.
"""

import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import nemo_run.config
from nemo_run.run.torchx_backend.schedulers import local as local_scheduler
from nemo_run.run.torchx_backend.schedulers import slurm as slurm_scheduler

from tests.helpers.distributed import forkserver

TIMEOUT_S = 600


def _nemorun_home(path: str) -> None:
    """NeMo-Run's home, and its job registries in it, as `NEMORUN_HOME=path` gives a fresh `nemo`."""
    nemo_run.config.set_nemorun_home(path)
    home = nemo_run.config.get_nemorun_home()
    local_scheduler.LOCAL_JOB_DIRS = os.path.join(home, ".local_jobs.json")
    slurm_scheduler.SLURM_JOB_DIRS = os.path.join(home, ".slurm_jobs")


def _child(main: Callable[[], object], argv: list[str], cwd: str, env: dict[str, str], output: str) -> None:
    with open(output, "wb") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), 0)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the process's stdin until it exits
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _nemorun_home(env.get("NEMORUN_HOME", "~/.nemo_run"))
    sys.argv = argv
    main()


def run_preloaded(
    main: Callable[[], object],
    argv: list[str],
    cwd: Path | str,
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> subprocess.CompletedProcess:
    """Run `main()` (a module-level function) as the program of a process with `argv`, `cwd` and `env` (default:
    this process's environment); its exit code is 0, a `SystemExit`'s code, or 1 for an exception (whose traceback it
    printed)."""
    env = dict(os.environ) if env is None else env
    with tempfile.TemporaryDirectory() as directory:
        output = os.path.join(directory, "output.txt")
        process = forkserver().Process(target=_child, args=(main, argv, str(cwd), env, output))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(argv, timeout, Path(output).read_bytes())
        return subprocess.CompletedProcess(argv, process.exitcode, Path(output).read_text(errors="replace"))


def _nemo_main() -> None:
    from nemo_run.__main__ import app

    app()


def _script_main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")


def nemo(
    *args: str, cwd: Path | str = ".", env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """`nemo ARGS` (NeMo-Run's command line with this package's entry points) in `cwd`, with `env` (default: this
    process's environment)."""
    return run_preloaded(_nemo_main, ["nemo", *args], cwd, env, timeout)


def python_script(
    script: str, cwd: Path | str, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """`python SCRIPT` in `cwd`, with `env` (default: this process's environment); the script's directory first on
    `sys.path`, as Python puts it."""
    return run_preloaded(_script_main, [script], cwd, env, timeout)

"""Run a test body, or a whole recipe, on N gloo processes on this machine (CPU).

The ranks are forked from Python's forkserver, whose server imported `PRELOAD` once per test session: a rank
starts in milliseconds instead of the seconds a fresh interpreter spends importing torch, Lightning and NeMo-Run
(13 s per process on a slow 2-core CI machine). Each rank gets the caller's environment at the call, as a spawned
process would.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import fiddle as fdl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

PRELOAD = ["torch", "lightning.pytorch", "nemo_run", "recipes", "tests.helpers.trainer"]


def forkserver() -> BaseContext:
    """The forkserver context; its server (started at first use, shared by the session) imports `PRELOAD`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_ranks(entry: Callable, world_size: int, *args: Any) -> None:
    """Fork ``entry(rank, world_size, port, environ, *args)`` on ``world_size`` ranks and wait for all of them."""
    forkserver()  # sets the server's preload, which counts only before its first start
    environ = dict(os.environ)
    mp.start_processes(
        entry, args=(world_size, free_port(), environ, *args), nprocs=world_size, join=True, start_method="forkserver"
    )


def _set_environment(rank: int, world_size: int, port: int, environ: dict[str, str]) -> None:
    """The caller's environment plus the rank's address in the job."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )


def _worker(
    rank: int, world_size: int, port: int, environ: dict[str, str], fn: Callable, args: tuple, results: Any
) -> None:
    _set_environment(rank, world_size, port, environ)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``fn`` must be a module-level function. Returns each rank's return value; a failure on
    any rank is re-raised here with that rank's traceback.
    """
    with mp.Manager() as manager:
        results = manager.dict()
        _start_ranks(_worker, world_size, fn, args, results)
        return [results[rank] for rank in range(world_size)]


def _recipe_rank(
    rank: int, world_size: int, port: int, environ: dict[str, str], recipe: Callable, args: tuple, logs: Path | None
) -> None:
    if logs is not None:
        with open(logs / f"rank{rank}.log", "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
    _set_environment(rank, world_size, port, environ)
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")  # torchrun's: `TorchElasticEnvironment`
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 for several ranks per node
    fdl.build(recipe(*args))()


def run_recipe(recipe: Callable, world_size: int, *args: Any, logs: Path | None = None) -> int:
    """Build ``recipe(*args)`` (a module-level function returning a `run.Partial`) and run it on ``world_size``
    ranks with torchrun's environment, as ``torchrun --nproc-per-node`` would; Lightning sets up the process group.
    With ``logs``, each rank's output is appended to ``logs/rank<R>.log`` (torchrun's ``--log-dir``).

    Returns 0, or the exit code of the first rank that failed (1 for a Python exception, whose traceback is
    printed; ``-9`` for SIGKILL); the other ranks are then stopped, as torchrun stops them.
    """
    try:
        _start_ranks(_recipe_rank, world_size, recipe, args, logs)
    except ProcessExitedException as failure:
        return failure.exit_code
    except ProcessRaisedException as failure:
        print(failure)
        return 1
    return 0

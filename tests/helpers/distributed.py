"""Run a test body on N gloo processes on this machine (CPU).

The ranks are forked from Python's forkserver, whose server imported `PRELOAD` once per test session: a rank
starts in milliseconds instead of the seconds a fresh interpreter spends importing torch and Lightning. Each rank
gets the caller's environment at the call, as a spawned process would.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

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


def _worker(
    rank: int, world_size: int, port: int, environ: dict[str, str], fn: Callable, args: tuple, results: Any
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
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
    forkserver()  # sets the server's preload, which counts only before its first start
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), dict(os.environ), fn, args, results),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
        return [results[rank] for rank in range(world_size)]

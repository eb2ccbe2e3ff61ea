"""Run a test body on N gloo processes on this machine (CPU)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be a module-level function. Returns each rank's return value; a failure on
    any rank is re-raised here with that rank's traceback.
    """
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world_size, free_port(), fn, args, results), nprocs=world_size, join=True)
        return [results[rank] for rank in range(world_size)]

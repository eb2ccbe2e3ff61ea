"""Session-wide test settings."""

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _thread_settings_do_not_leak() -> Iterator[None]:
    """Undo what an in-process `Trainer` does where `OMP_NUM_THREADS` is unset: it sets the variable (to the cores per
    process) and torch's thread count for the whole test process, and later tests' subprocesses (torchrun ranks, Slurm
    jobs) would inherit it. They get a user's shell instead: no `OMP_NUM_THREADS`, so the launchers' default of 1."""
    variable, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    yield
    if variable is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = variable
    torch.set_num_threads(threads)

"""Async saves that fail: a writer stuck past `ckpt_async_save_timeout` fails on every rank instead of blocking
training forever; with `ckpt_async_save_failure='warn'` a failed save (disk full) is discarded and the next save
works, with 'raise' it stops the run."""

import functools
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.strategies.async_utils import AsyncRequest, AsyncSaveFailure
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions
from tests.helpers.distributed import run_distributed


def _stuck_writer_on_rank_1(rank: int, world_size: int) -> dict:
    """Under each policy: rank 1's writer sleeps for a minute, rank 0's returns at once."""
    results = {}
    for policy in ("raise", "warn"):
        io = DistCheckpointIO(
            DistCheckpointOptions(ckpt_async_save=True, ckpt_async_save_timeout=2.0, ckpt_async_save_failure=policy)
        )
        finalized, discarded = [], []
        request = AsyncRequest(time.sleep, (60 if rank == 1 else 0,), [functools.partial(finalized.append, 1)])
        io._failure_fns[io.async_calls.schedule_async_request(request)] = functools.partial(discarded.append, 1)
        start = time.monotonic()
        try:
            io.maybe_finalize(blocking=True)
            error = None
        except AsyncSaveFailure as failure:
            error = str(failure)
        results[policy] = {"error": error, "seconds": time.monotonic() - start, "finalized": finalized}
        results[policy]["discarded"] = discarded
    return results


def test_stuck_writer_fails_on_every_rank_after_the_timeout():
    rank0, rank1 = run_distributed(_stuck_writer_on_rank_1, 2)
    assert "ckpt_async_save_timeout=2.0" in rank1["raise"]["error"]
    assert "failed on another rank" in rank0["raise"]["error"]
    for result in (rank0, rank1):
        assert result["raise"]["seconds"] < 30 and result["raise"]["finalized"] == []
        assert result["warn"]["error"] is None and result["warn"]["discarded"] == [1]
        assert result["warn"]["seconds"] < 30 and result["warn"]["finalized"] == []


def _state(mib: float, value: float) -> dict:
    return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((int(mib * 2**18),), value))}


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 3 MiB tmpfs (root), else a directory whose writes fail with ENOSPC past 3 MiB (see `_full_disk_writer`)."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None
    mounted = mounted and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(path)]).returncode == 0
    if not mounted:
        pytest.skip("needs root to mount a small tmpfs")
    yield path
    subprocess.run(["umount", str(path)])


@pytest.mark.parametrize("writer_process", [False, True], ids=["writer-thread", "writer-process"])
@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_disk_full_async_save(small_disk, policy, writer_process, caplog):
    io = DistCheckpointIO(
        DistCheckpointOptions(
            ckpt_async_save=True,
            ckpt_async_save_failure=policy,
            ckpt_assume_constant_structure=writer_process,
            ckpt_async_writer_process=writer_process,
        )
    )
    committed, discarded = [], []

    def save(name: str, mib: float, value: float) -> None:
        io.save_checkpoint(
            _state(mib, value),
            small_disk / name,
            storage_options={
                "finalize_fn": lambda: committed.append(name),
                "failure_fn": lambda: (discarded.append(name), shutil.rmtree(small_disk / name)),
            },
        )

    save("first", 1, 1.0)
    io.maybe_finalize(blocking=True)
    save("too-big", 4, 2.0)
    if policy == "raise":
        with pytest.raises(AsyncSaveFailure, match="No space left"):
            io.maybe_finalize(blocking=True)
        assert committed == ["first"] and discarded == []
    else:
        with caplog.at_level(logging.WARNING):
            io.maybe_finalize(blocking=True)
        assert "No space left" in caplog.text and "training goes on" in caplog.text
        assert discarded == ["too-big"] and not (small_disk / "too-big").exists()
        save("next", 1, 3.0)  # the next interval saves again
        io.teardown()
        assert committed == ["first", "next"]
        assert torch.equal(
            io.load_checkpoint(small_disk / "next", sharded_state_dict=_state(1, 0.0))["w"], _state(1, 3.0)["w"].data
        )
    loaded = io.load_checkpoint(small_disk / "first", sharded_state_dict=_state(1, 0.0))
    assert torch.equal(loaded["w"], _state(1, 1.0)["w"].data)  # the earlier checkpoint is intact

"""Async save: staged on CPU at the call, written in the background, completed (metadata.json) at finalize;
a background failure on any rank raises on every rank at finalize; the writer runs at a lower priority."""

import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.strategies.async_utils import WRITER_NICE, AsyncCallsQueue, AsyncRequest
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.helpers.distributed import run_distributed


def full(i: int) -> torch.Tensor:
    return torch.arange(8 * 16, dtype=torch.float32).view(8, 16) * (i + 1)


def state(rank: int, world_size: int, template: bool = False) -> dict:
    return {
        f"w{i}": dc.ShardedTensor.from_rank_offsets(
            f"w{i}",
            torch.zeros(8 // world_size, 16) if template else full(i).chunk(world_size)[rank].clone(),
            (0, rank, world_size),
        )
        for i in range(3)
    }


def _async_roundtrip(rank: int, world_size: int, directory: str) -> dict:
    directory = Path(directory)
    queue = AsyncCallsQueue()
    sharded = state(rank, world_size)
    request = dc.save(sharded, directory, TorchDistSaveShardedStrategy(), async_sharded_save=True)
    for sh_ten in sharded.values():
        sh_ten.data.add_(1000)  # training goes on: the checkpoint keeps the values at the save call
    queue.schedule_async_request(request)
    complete_before_finalize = (directory / "metadata.json").exists()
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    loaded = dc.load(state(rank, world_size, template=True), directory)
    correct = all(torch.equal(loaded[f"w{i}"], full(i).chunk(world_size)[rank]) for i in range(3))
    queue.close()
    return {"early": complete_before_finalize, "finalized": finalized, "correct": correct}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_async_save_completes_at_finalize_with_values_of_the_call(tmp_path, world_size):
    for result in run_distributed(_async_roundtrip, world_size, str(tmp_path)):
        assert result == {"early": False, "finalized": [0], "correct": True}


def _failure_on_one_rank(rank: int, world_size: int, directory: str) -> str:
    directory = Path(directory)
    queue = AsyncCallsQueue()
    gate = threading.Event()
    queue.schedule_async_request(AsyncRequest(gate.wait, (), []))  # holds the background worker
    request = dc.save(state(rank, world_size), directory, TorchDistSaveShardedStrategy(), async_sharded_save=True)
    queue.schedule_async_request(request)
    if rank == 1:
        (directory / "__1_0.distcp").mkdir()  # rank 1's data file cannot be written
    not_yet = queue.maybe_finalize_async_calls(blocking=False)
    gate.set()
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except dc.CheckpointingException as error:
        message = str(error)
    else:
        message = "no error"
    dist.barrier()
    complete = (directory / "metadata.json").exists()
    queue.close()
    return f"{not_yet} {complete} {message}"


def test_background_failure_raises_on_every_rank_and_leaves_checkpoint_incomplete(tmp_path):
    rank0, rank1 = run_distributed(_failure_on_one_rank, 2, str(tmp_path))
    assert rank0 == "[] False Async checkpoint save #1 failed on another rank"
    assert rank1.startswith("[] False Async checkpoint save #1 failed: IsADirectoryError")


def test_finalize_runs_in_order_and_close_waits_for_all():
    queue = AsyncCallsQueue()
    order = []
    for idx in range(3):
        queue.schedule_async_request(
            AsyncRequest(order.append, (f"write{idx}",), [lambda i=idx: order.append(f"final{i}")])
        )
    queue.close()
    assert order == ["write0", "write1", "write2", "final0", "final1", "final2"]
    assert queue.get_num_unfinalized_calls() == 0


def test_frozen_request_takes_no_more_finalize_fns():
    request = AsyncRequest(None, (), []).freeze()
    with pytest.raises(RuntimeError, match="frozen"):
        request.add_finalize_fn(lambda: None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have their own priority on Linux only")
def test_background_writer_and_the_threads_it_starts_run_at_the_lowest_priority():
    def priority() -> tuple[int, int]:
        thread = threading.get_native_id()
        return os.sched_getscheduler(thread), os.getpriority(os.PRIO_PROCESS, thread)

    seen = {}

    def write() -> None:
        seen["writer"] = priority()
        file_writer = threading.Thread(target=lambda: seen.__setitem__("file writer", priority()))
        file_writer.start()
        file_writer.join()

    training = priority()
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(write, (), []))
    queue.close()
    lowest = (os.SCHED_IDLE, min(19, training[1] + WRITER_NICE))
    assert seen == {"writer": lowest, "file writer": lowest}
    assert priority() == training, "the training thread keeps its priority"


def test_async_save_writes_the_common_state_in_the_background_with_the_values_of_the_call(tmp_path):
    queue = AsyncCallsQueue()
    gate = threading.Event()
    queue.schedule_async_request(AsyncRequest(gate.wait, (), []))  # the writer is busy with an earlier save
    step = torch.tensor(5)
    request = dc.save({**state(0, 1), "step": step}, tmp_path, TorchDistSaveShardedStrategy(), async_sharded_save=True)
    step.add_(1)  # training goes on
    queue.schedule_async_request(request)
    assert not (tmp_path / "common.pt").exists(), "the training thread neither writes nor fsyncs common.pt"
    gate.set()
    queue.close()
    assert dc.load_common_state_dict(tmp_path)["step"] == 5
    assert dc.load(state(0, 1, template=True), tmp_path)["step"] == 5

"""The writer process of async saves: tensors in shared memory seen by both processes, calls answered or their
errors raised, a process that died reported and replaced, the lowest CPU priority, and an end when its parent
ends; async saves with kept buffers are written there."""

import errno
import os
import subprocess
import sys
import time

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.core import CheckpointingException
from nemo_ckpt.dist_checkpointing.integrity import verify_checkpoint
from nemo_ckpt.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from nemo_ckpt.dist_checkpointing.strategies.writer_process import (
    ALIGNMENT,
    SharedArena,
    WriterProcess,
    shared_memory_available,
    shared_writer_process,
)

pytestmark = pytest.mark.skipif(not shared_memory_available(), reason="the writer process needs Linux (memfd)")

LAYOUT = [
    (torch.float32, (3, 5)),
    (torch.bfloat16, (7,)),
    (torch.bool, (2, 2)),
    (torch.int64, ()),
    (torch.float32, (0,)),
]


def sums_and_pid(tensors: dict) -> tuple[int, dict]:
    """Run in the writer process: its pid and each tensor's values."""
    return os.getpid(), {name: tensor.tolist() for name, tensor in tensors.items()}


def zero(tensors: dict) -> None:
    """Run in the writer process: write into the shared tensors."""
    for tensor in tensors.values():
        tensor.zero_()


def disk_full(_: dict) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def process():
    writer = WriterProcess()
    yield writer
    writer.close()


def test_arena_tensors_own_their_bytes_on_page_boundaries():
    arena = SharedArena(LAYOUT)
    for tensor, place, (dtype, shape) in zip(arena.tensors, arena.places, LAYOUT):
        assert tensor.dtype == dtype and tuple(tensor.shape) == shape
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        if tensor.numel():
            assert tensor.data_ptr() % ALIGNMENT == 0 and place.offset % ALIGNMENT == 0
    ends = [p.offset + t.numel() * t.element_size() for p, t in zip(arena.places, arena.tensors)]
    assert all(end <= nxt.offset for end, nxt in zip(ends, arena.places[1:3]))  # no overlap


def test_the_process_sees_and_changes_the_shared_values(process):
    arena = SharedArena(LAYOUT[:3])
    names = ["f", "h", "b"]
    for tensor, value in zip(arena.tensors, (1.5, 2.0, 1)):
        tensor.fill_(value)
    done, (pid, values) = process.try_call(arena, sums_and_pid, dict(zip(names, arena.places)))
    assert done and pid == process.pid != os.getpid()
    assert values == {name: tensor.tolist() for name, tensor in zip(names, arena.tensors)}
    process.try_call(arena, zero, {"f": arena.places[0]})
    assert torch.equal(arena.tensors[0], torch.zeros(3, 5))
    second = SharedArena([(torch.float32, (4,))])  # a new arena reaches the same process
    second.tensors[0].copy_(torch.arange(4.0))
    assert process.try_call(second, sums_and_pid, {"x": second.places[0]})[1][1] == {"x": [0.0, 1.0, 2.0, 3.0]}


def test_errors_of_the_call_are_raised_in_the_caller_and_the_process_goes_on(process):
    arena = SharedArena(LAYOUT[:1])
    with pytest.raises(OSError, match="No space left") as error:
        process.try_call(arena, disk_full, {})
    assert error.value.errno == errno.ENOSPC
    assert process.try_call(arena, sums_and_pid, {})[1][0] == process.pid


def test_a_process_that_died_is_reported_with_its_exit_code(process):
    arena = SharedArena(LAYOUT[:1])
    process.process.kill()
    process.process.wait()
    with pytest.raises(CheckpointingException, match=rf"writer process \(pid {process.pid}\) ended with exit code -9"):
        process.try_call(arena, sums_and_pid, {})
    assert not process.alive


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="no scheduling classes")
def test_the_process_runs_at_the_lowest_priority(process):
    process.try_call(SharedArena(LAYOUT[:1]), sums_and_pid, {})  # it lowers its priority once started
    assert os.sched_getscheduler(process.pid) == os.SCHED_IDLE


def test_the_process_ends_with_its_parent(tmp_path):
    parent = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os\nfrom nemo_ckpt.dist_checkpointing.strategies.writer_process import WriterProcess\n"
            "print(WriterProcess().pid, flush=True)\nos._exit(0)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    child = int(parent.stdout)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _running(child):
        time.sleep(0.1)
    assert not _running(child), "the writer process outlived its parent"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _state(value: float, template: bool = False) -> dict:
    return {
        f"w{i}": dc.ShardedTensor.from_rank_offsets(
            f"w{i}", torch.zeros(256, 256) if template else torch.full((256, 256), value + i)
        )
        for i in range(3)
    } | {"obj": dc.ShardedObject("obj", None if template else {"step": value}, (1,), (0,))}


@pytest.mark.parametrize("writer_process", [True, False])
def test_async_saves_with_kept_buffers_are_written_by_the_process(tmp_path, writer_process):
    strategy = TorchDistSaveShardedStrategy(
        cached_metadata=True, reuse_staging_buffers=True, writer_process=writer_process
    )
    queue = AsyncCallsQueue()
    live = _state(1.0)
    calls_before = shared_writer_process().calls
    for step in (1, 2):
        (tmp_path / f"step{step}").mkdir()
        queue.schedule_async_request(dc.save(live, tmp_path / f"step{step}", strategy, async_sharded_save=True))
        for sh in live.values():
            if isinstance(sh, dc.ShardedTensor):
                sh.data.add_(10)  # training goes on
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert shared_writer_process().calls - calls_before == (2 if writer_process else 0)
    for step in (1, 2):
        loaded = dc.load(_state(0.0, template=True), tmp_path / f"step{step}")
        assert [loaded[f"w{i}"].unique().item() for i in range(3)] == [1.0 + 10 * (step - 1) + i for i in range(3)]
        assert loaded["obj"] == {"step": 1.0}
    assert verify_checkpoint(tmp_path / "step2") == []

"""Staging buffers kept between saves (`reuse_staging_buffers`, on with `assume_constant_structure`):
the next save copies into the same memory, a save staged while an earlier one still writes gets new
memory, and every checkpoint holds the values of its own save call (GPU shards: staged into pinned memory
on a side stream, loaded straight into GPU tensors)."""

import gc
import io
import threading
import weakref
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from nemo_ckpt.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync, StagingBuffers
from nemo_ckpt.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    build_write_items,
)
from tests.helpers.distributed import run_distributed


def test_buffers_are_reused_after_release_and_hold_the_new_values():
    staging = StagingBuffers()
    data = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    first, release = staging.stage(data, copy=True)
    assert all(first[k].data_ptr() != data[k].data_ptr() for k in data)
    release()
    data["a"].mul_(10)
    second, _ = staging.stage(data, copy=True)
    assert all(second[k].data_ptr() == first[k].data_ptr() for k in data)
    assert torch.equal(second["a"], torch.arange(6.0).view(2, 3) * 10)
    assert second["b"].dtype == torch.bfloat16 and torch.equal(second["b"], data["b"])


def test_buffers_in_use_are_not_handed_out_again():
    staging = StagingBuffers()
    data = {"a": torch.zeros(3)}
    lent, release = staging.stage(data, copy=True)
    data["a"].fill_(7)
    meanwhile, release_meanwhile = staging.stage(data, copy=True)
    assert meanwhile["a"].data_ptr() != lent["a"].data_ptr()
    assert torch.equal(lent["a"], torch.zeros(3)) and torch.equal(meanwhile["a"], torch.full((3,), 7.0))
    release_meanwhile()  # returns nothing: the kept buffers are still those lent first
    again, _ = staging.stage(data, copy=True)
    assert again["a"].data_ptr() != lent["a"].data_ptr()
    release()
    after, _ = staging.stage(data, copy=True)
    assert after["a"].data_ptr() == lent["a"].data_ptr()


def test_changed_shape_or_dtype_gets_a_new_buffer_and_sync_saves_copy_only_what_they_must():
    staging = StagingBuffers()
    first, release = staging.stage({"a": torch.zeros(4), "b": torch.zeros(2)}, copy=True)
    release()
    second, _ = staging.stage({"a": torch.zeros(5), "b": torch.zeros(2, dtype=torch.float64)}, copy=True)
    assert second["a"].shape == (5,) and second["b"].dtype == torch.float64
    plain, view, blob = torch.zeros(4), torch.zeros(4, 4)[:, 1], io.BytesIO(b"object")
    synced, _ = StagingBuffers().stage({"plain": plain, "view": view, "blob": blob}, copy=False)
    assert synced["plain"] is plain and synced["blob"] is blob
    assert synced["view"].is_contiguous() and synced["view"].untyped_storage().nbytes() == 16


@pytest.mark.parametrize("keep", [False, True])
def test_copies_live_past_the_write_only_when_kept(tmp_path, keep):
    items, data = build_write_items({"w": dc.ShardedTensor.from_rank_offsets("w", torch.ones(4, 4))})
    writer = FileSystemWriterAsync(tmp_path, staging=StagingBuffers() if keep else None)
    writer.prepare_write_data(items, data, copy=True)
    (staged,) = [weakref.ref(t) for t in writer.data.values()]
    writer.write()
    gc.collect()
    assert (staged() is not None) == keep, "without kept buffers the copy is freed once written"
    assert writer.results[0].size_in_bytes > 0


def state(rank: int, world_size: int, value: float, template: bool = False) -> dict:
    return {
        f"w{i}": dc.ShardedTensor.from_rank_offsets(
            f"w{i}",
            torch.zeros(4, 16) if template else torch.full((4, 16), value + i + 100 * rank),
            (0, rank, world_size),
        )
        for i in range(3)
    }


def _saves_reuse_and_overlap(rank: int, world_size: int, directory: str) -> dict:
    directory = Path(directory)
    for step in (1, 2, 3, 4):
        (directory / f"step{step}").mkdir(exist_ok=True)
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True, reuse_staging_buffers=True)
    queue = AsyncCallsQueue()
    live = state(rank, world_size, 1.0)
    pointers = []
    for step in (1, 2):
        request = dc.save(live, directory / f"step{step}", strategy, async_sharded_save=True)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        pointers.append(sorted(t.data_ptr() for t in strategy._staging._buffers.values()))
        for sh in live.values():
            sh.data.add_(1)
    gate = threading.Event()
    queue.schedule_async_request(AsyncRequest(gate.wait, (), []))  # holds the writer: step 3 stays unwritten
    queue.schedule_async_request(dc.save(live, directory / "step3", strategy, async_sharded_save=True))
    for sh in live.values():
        sh.data.add_(1)
    queue.schedule_async_request(dc.save(live, directory / "step4", strategy, async_sharded_save=True))
    for sh in live.values():
        sh.data.add_(1)
    gate.set()
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    values = {}
    for step in (1, 2, 3, 4):
        loaded = dc.load(state(rank, world_size, 0.0, template=True), directory / f"step{step}")
        values[step] = [loaded[f"w{i}"].unique().tolist() for i in range(3)]
    return {"reused": pointers[0] == pointers[1], "values": values}


@pytest.mark.parametrize("world_size", [1, 2])
def test_async_saves_reuse_buffers_and_keep_the_values_of_their_call(tmp_path, world_size):
    for rank, result in enumerate(run_distributed(_saves_reuse_and_overlap, world_size, str(tmp_path))):
        assert result["reused"]
        assert result["values"] == {step: [[float(step + i + 100 * rank)] for i in range(3)] for step in (1, 2, 3, 4)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_shards_are_staged_in_pinned_memory_without_blocking_and_keep_the_values_of_the_call(tmp_path):
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True, reuse_staging_buffers=True)
    queue = AsyncCallsQueue()
    live = torch.arange(1 << 20, dtype=torch.float32, device="cuda").view(1024, 1024)
    expected = live.cpu()
    for step in (1, 2):
        (tmp_path / f"step{step}").mkdir()
        request = dc.save(
            {"w": dc.ShardedTensor.from_rank_offsets("w", live)},
            tmp_path / f"step{step}",
            strategy,
            async_sharded_save=True,
        )
        live.mul_(2)  # queued after the copy on the current stream: the checkpoint keeps the values of the call
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        assert all(buffer.is_pinned() for buffer in strategy._staging._buffers.values())
        loaded = dc.load(
            {"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(1024, 1024, device="cuda"))},
            tmp_path / f"step{step}",
            TorchDistLoadShardedStrategy(load_directly_on_device=True),
        )
        assert loaded["w"].is_cuda and torch.equal(loaded["w"].cpu(), expected * 2 ** (step - 1))
    queue.close()

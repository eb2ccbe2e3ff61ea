"""torch_dist writer options: writer threads (files per rank) and cached metadata across saves."""

import pickle
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from tests.helpers.distributed import run_distributed


def tensors(rank: int, world_size: int, count: int, step: int = 0) -> dict:
    return {
        f"t{i}": dc.ShardedTensor.from_rank_offsets(
            f"t{i}", torch.full((4, 32), float(100 * step + 10 * i + rank)), (0, rank, world_size)
        )
        for i in range(count)
    }


def _threads(rank: int, world_size: int, directory: str) -> bool:
    dc.save(tensors(rank, world_size, 6), Path(directory), TorchDistSaveShardedStrategy(thread_count=3))
    template = {
        f"t{i}": dc.ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(4, 32), (0, rank, world_size))
        for i in range(6)
    }
    loaded = dc.load(template, Path(directory))
    return all(torch.equal(loaded[f"t{i}"], torch.full((4, 32), float(10 * i + rank))) for i in range(6))


@pytest.mark.parametrize("world_size", [1, 2])
def test_thread_count_writes_that_many_files_per_rank(tmp_path, world_size):
    assert all(run_distributed(_threads, world_size, str(tmp_path)))
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == [
        f"__{rank}_{i}.distcp" for rank in range(world_size) for i in range(3)
    ]


def _cached(rank: int, world_size: int, directory: str) -> list[bool]:
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    counts = [3, 3, 3, 4]  # the fourth save adds a tensor: the cache must not hide it
    ok = []
    for step, count in enumerate(counts):
        target = Path(directory) / f"step{step}"
        if rank == 0:
            target.mkdir()
        torch.distributed.barrier()
        dc.save(tensors(rank, world_size, count, step), target, strategy)
        loaded = dc.load_plain_tensors(target)
        ok.append(
            sorted(loaded) == [f"t{i}" for i in range(count)]
            and all(
                torch.equal(loaded[f"t{i}"][4 * r : 4 * r + 4], torch.full((4, 32), float(100 * step + 10 * i + r)))
                for i in range(count)
                for r in range(world_size)
            )
        )
    return ok


def test_cached_metadata_reused_while_structure_holds_and_refreshed_when_it_changes(tmp_path):
    assert run_distributed(_cached, 2, str(tmp_path)) == [[True] * 4] * 2
    metadata = [pickle.load(open(tmp_path / f"step{step}" / ".metadata", "rb")) for step in range(3)]
    assert metadata[0].state_dict_metadata == metadata[2].state_dict_metadata
    assert metadata[0].storage_data.keys() == metadata[2].storage_data.keys()


def test_bad_thread_count_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="thread_count=0"):
        dc.save(tensors(0, 1, 1), tmp_path, TorchDistSaveShardedStrategy(thread_count=0))

"""Fully parallel save and load: replicated shards written once, spread over the ranks, read once."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from tests.helpers.distributed import run_distributed

SIZES = [64, 48, 32, 32, 16, 16, 8, 8]  # rows of 256 float32 values


def replicated_tensor(i: int) -> torch.Tensor:
    return torch.arange(SIZES[i] * 256, dtype=torch.float32).view(SIZES[i], 256) + 1000 * i


def replicated_state(rank: int, template: bool = False) -> dict:
    """What data parallelism holds: every rank the same tensors, rank 0 the main replica."""
    return {
        f"layer{i}": dc.ShardedTensor.from_rank_offsets(
            f"layer{i}", torch.zeros(SIZES[i], 256) if template else replicated_tensor(i), replica_id=rank
        )
        for i in range(len(SIZES))
    }


class RecordingLoadStrategy(TorchDistLoadShardedStrategy):
    """The real torch_dist reader, remembering which shards it was asked to read from storage."""

    def __init__(self) -> None:
        super().__init__()
        self.read_keys: list[str] = []

    def load(self, sharded_state_dict, checkpoint_dir):
        self.read_keys += [sh.key for sh in sharded_state_dict.values() if isinstance(sh, dc.ShardedTensor)]
        return super().load(sharded_state_dict, checkpoint_dir)


def _save_and_load(rank: int, world_size: int, directory: str) -> dict:
    directory = Path(directory)
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    dc.save(replicated_state(rank), directory, strategy)
    reader = RecordingLoadStrategy()
    loaded = dc.load(replicated_state(rank, template=True), directory, FullyParallelLoadStrategyWrapper(reader))
    correct = all(torch.equal(loaded[f"layer{i}"], replicated_tensor(i)) for i in range(len(SIZES)))
    return {"correct": correct, "read": reader.read_keys}


def rank_bytes(directory: Path, rank: int) -> int:
    """Bytes in the data files of ``rank`` (one per writer thread)."""
    return sum(path.stat().st_size for path in directory.glob(f"__{rank}_*.distcp"))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_replicas_written_once_evenly_and_read_once(tmp_path, world_size):
    results = run_distributed(_save_and_load, world_size, str(tmp_path))
    assert all(result["correct"] for result in results)
    read = [key for result in results for key in result["read"]]
    assert sorted(read) == sorted(f"layer{i}" for i in range(len(SIZES))), "every shard read from storage once"

    file_sizes = [rank_bytes(tmp_path, rank) for rank in range(world_size)]
    total = sum(SIZES) * 256 * 4
    assert sum(file_sizes) >= total
    assert max(file_sizes) <= total / world_size * 1.15 + 4096, f"bytes not spread evenly: {file_sizes}"


def _save_within_groups(rank: int, world_size: int, directory: str) -> bool:
    """Two data-parallel groups {0, 1} and {2, 3}, each holding one half (tensor parallel) of every tensor."""
    tp_rank, dp_rank = rank // 2, rank % 2
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_group = groups[tp_rank]

    def state(template: bool) -> dict:
        return {
            f"layer{i}": dc.ShardedTensor.from_rank_offsets(
                f"layer{i}",
                torch.zeros(SIZES[i] // 2, 256) if template else replicated_tensor(i).chunk(2)[tp_rank],
                (0, tp_rank, 2),
                replica_id=dp_rank,
            )
            for i in range(len(SIZES))
        }

    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), parallelization_group=dp_group)
    dc.save(state(False), Path(directory), strategy)
    loaded = dc.load(
        state(True),
        Path(directory),
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), parallelization_group=dp_group),
    )
    return all(torch.equal(loaded[f"layer{i}"], replicated_tensor(i).chunk(2)[tp_rank]) for i in range(len(SIZES)))


def test_parallel_within_data_parallel_groups(tmp_path):
    assert all(run_distributed(_save_within_groups, 4, str(tmp_path)))
    file_sizes = [rank_bytes(tmp_path, rank) for rank in range(4)]
    assert all(size > 0 for size in file_sizes), f"every rank of each DP group writes: {file_sizes}"
    whole = dc.load_plain_tensors(tmp_path)
    assert all(torch.equal(whole[f"layer{i}"], replicated_tensor(i)) for i in range(len(SIZES)))


@pytest.mark.parametrize("exchange_algo", ["broadcast", "gather_object", "gather_rounds"])
def test_megatron_api_names_build_the_parallel_strategies(tmp_path, exchange_algo):
    from nemo_ckpt.dist_checkpointing import serialization

    save = FullyParallelSaveStrategyWrapper(serialization.get_default_save_sharded_strategy("torch_dist", 1))
    dc.save(replicated_state(0), tmp_path, save)
    load = FullyParallelLoadStrategyWrapper(
        serialization.get_default_load_sharded_strategy(tmp_path), None, False, exchange_algo=exchange_algo
    )
    loaded = dc.load(replicated_state(0, template=True), tmp_path, load)
    assert all(torch.equal(loaded[f"layer{i}"], replicated_tensor(i)) for i in range(len(SIZES)))


def test_unknown_exchange_algo_is_refused():
    with pytest.raises(ValueError, match="exchange_algo='scatter'.*'gather_rounds'"):
        FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), exchange_algo="scatter")

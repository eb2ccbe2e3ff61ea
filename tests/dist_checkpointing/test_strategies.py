"""Default strategies dispatched by (backend, version), auto-detection from metadata.json, a format of one's own
passed as strategy objects, and the common strategy storing ShardedObjects when the sharded strategy cannot.
In-process (world size 1)."""

import json
import os

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import ShardedObject, ShardedTensor
from nemo_ckpt.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from nemo_ckpt.dist_checkpointing.strategies.common import TorchCommonLoadStrategy, TorchCommonSaveStrategy
from nemo_ckpt.dist_checkpointing.strategies.defaults import default_load_common_strategy
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy


class TensorsOnlySave(TorchDistSaveShardedStrategy):
    """Same DCP format for tensors but leaves ShardedObjects to the common strategy."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False


class TensorsOnlyLoad(TorchDistLoadShardedStrategy):
    backend = "tensors_only"

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False


def _state(template: bool) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(3) if template else torch.arange(3.0)),
        "o": ShardedObject("obj", None if template else [1, 2], (1,), (0,)),
        "step": 4,
    }


def test_default_strategies_and_explicit_ones(tmp_path):
    assert isinstance(get_default_save_sharded_strategy(), TorchDistSaveShardedStrategy)
    assert isinstance(get_default_save_sharded_strategy("torch_dist", 1), TorchDistSaveShardedStrategy)
    assert isinstance(default_load_common_strategy("torch", 1), TorchCommonLoadStrategy)
    with pytest.raises(dc.CheckpointingException, match=r"\('save_sharded', 'zarr', 1\)"):
        get_default_save_sharded_strategy("zarr", 1)
    dc.save(_state(False), tmp_path, TorchDistSaveShardedStrategy("torch_dist", 1), ("torch", 1))
    assert isinstance(get_default_load_sharded_strategy(tmp_path), TorchDistLoadShardedStrategy)
    loaded = dc.load(_state(True), tmp_path, TorchDistLoadShardedStrategy(), TorchCommonLoadStrategy())
    assert loaded["w"].tolist() == [0, 1, 2] and loaded["o"] == [1, 2] and loaded["step"] == 4
    assert dc.load(_state(True), tmp_path, ("torch_dist", 1), ("torch", 1))["o"] == [1, 2]


def test_own_backend_is_recorded_and_loads_with_its_strategy(tmp_path):
    dc.save(_state(False), tmp_path, TensorsOnlySave("tensors_only", 1), TorchCommonSaveStrategy())
    config = json.loads((tmp_path / "metadata.json").read_text())
    assert config["sharded_backend"] == "tensors_only" and config["common_backend"] == "torch"
    assert os.path.isfile(tmp_path / "obj" / "shard_0_1.pt")  # written by the common strategy
    loaded = dc.load(_state(True), tmp_path, TensorsOnlyLoad())  # common strategy picked from metadata.json
    assert loaded["w"].tolist() == [0, 1, 2] and loaded["o"] == [1, 2] and loaded["step"] == 4
    assert set(dc.load_sharded_metadata(tmp_path, TensorsOnlyLoad())) == {"w", "obj/shard_0_1"}
    no_default = r"\('load_sharded', 'tensors_only', 1\).*pass a strategy"
    with pytest.raises(dc.CheckpointingException, match=no_default):
        dc.load(_state(True), tmp_path)  # no default strategy reads this format
    with pytest.raises(
        dc.CheckpointingException, match="TorchDistLoadShardedStrategy cannot load backend 'tensors_only'"
    ):
        dc.load(_state(True), tmp_path, TorchDistLoadShardedStrategy())

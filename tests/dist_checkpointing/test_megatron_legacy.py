"""Checkpoints of megatron-core <= 0.18 (here 0.15.3): their `.metadata` names Megatron's `MCoreMetadata`, and
distributed-optimizer states saved with `from_rank_offsets_flat` are stored in its reformulated layout (one flat
row per local shard). Both load here, into any layout, from a fixture that megatron-core 0.15.3 wrote
(`fixtures/make_mcore_0_15_3.py`); with megatron-core 0.15.3 installed, the fixture is written afresh too."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.safe_globals import LegacyMCoreMetadata, UnsafeCheckpointError
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests.dist_checkpointing.fixtures.make_mcore_0_15_3 import EXP_AVG_A, EXP_AVG_B, WEIGHT
from tests.helpers.megatron import megatron_core_sites

FIXTURE = Path(__file__).parent / "fixtures" / "mcore_0_15_3"
MCORE_0_15 = megatron_core_sites().get("0.15.3", Path(sys.prefix) / "megatron-core-0.15.3")


def _check_loads_in_every_layout(checkpoint: Path) -> None:
    metadata = TorchDistLoadShardedStrategy()._reader(checkpoint).read_metadata()
    assert isinstance(metadata, LegacyMCoreMetadata) and set(metadata.mcore_data) == {
        "optimizer.state.exp_avg.a",
        "optimizer.state.exp_avg.b",
    }
    plain = dc.load_plain_tensors(checkpoint)
    assert torch.equal(plain["decoder.w"], WEIGHT)
    assert torch.equal(plain["optimizer.state.exp_avg.a"], EXP_AVG_A)
    assert torch.equal(plain["optimizer.state.exp_avg.b"], EXP_AVG_B)
    rng = [dc.ShardedObject("rng", None, (2,), (i,)) for i in range(2)]
    loaded = dc.load({"rng": rng}, checkpoint)
    assert loaded["rng"] == [{"rank": 0}, {"rank": 1}] and loaded["iteration"] == 7
    assert dc.load_tensors_metadata(checkpoint)["optimizer.state.exp_avg.b"].global_shape == (8, 6)


def test_megatron_0_15_checkpoint_loads_whole(tmp_path):
    _check_loads_in_every_layout(FIXTURE)


def _load_resharded(rank: int, world_size: int, checkpoint: str) -> None:
    """Another distributed-optimizer layout (flat ranges crossing the saved shards) and a column split."""
    bounds = [0, 20, 48] if world_size == 2 else [0, 48]
    flat = slice(bounds[rank], bounds[rank + 1])
    state = {
        "b_flat": dc.ShardedTensor.from_rank_offsets_flat(
            "optimizer.state.exp_avg.b", torch.zeros(flat.stop - flat.start), (8, 6), flattened_range=flat
        ),
        "a_cols": dc.ShardedTensor.from_rank_offsets(
            "optimizer.state.exp_avg.a", torch.zeros(4, 6 // world_size), (1, rank, world_size)
        ),
    }
    loaded = dc.load(state, checkpoint, validate_access_integrity=world_size == 1)  # here one process per call
    assert torch.equal(loaded["b_flat"], EXP_AVG_B.flatten()[flat])
    columns = 6 // world_size
    assert torch.equal(loaded["a_cols"], EXP_AVG_A[:, rank * columns : (rank + 1) * columns])


def test_megatron_0_15_flat_optimizer_state_reshards():
    _load_resharded(0, 1, str(FIXTURE))
    for rank in range(2):  # each rank of a 2-rank layout reads its part alone (no collective in a load)
        _load_resharded(rank, 2, str(FIXTURE))


def test_metadata_names_megatron_class_and_other_megatron_classes_are_refused(tmp_path):
    raw = (FIXTURE / ".metadata").read_bytes()
    assert b"MCoreMetadata" in raw
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(raw.replace(b"MCoreMetadata", b"MCoreEvilData"))
    with pytest.raises(UnsafeCheckpointError, match="MCoreEvilData"):
        dc.load_plain_tensors(tmp_path / "ckpt")


@pytest.mark.skipif(not (MCORE_0_15 / "megatron" / "core").is_dir(), reason=f"megatron-core 0.15.3 not in {MCORE_0_15}")
def test_checkpoint_written_now_by_megatron_core_0_15_loads(tmp_path):
    script = Path(__file__).parent / "fixtures" / "make_mcore_0_15_3.py"
    env = {**os.environ, "PYTHONPATH": str(MCORE_0_15)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    _check_loads_in_every_layout(tmp_path)

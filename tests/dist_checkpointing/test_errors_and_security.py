"""Clear errors for bad checkpoints and requests; safe unpickling by default.

Runs in this process without torch.distributed (world size 1)."""

import json
import os
import pickle

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import ShardedObject, ShardedTensor
from nemo_ckpt.dist_checkpointing.integrity import CHECKSUMS_FNAME, CorruptCheckpointError
from nemo_ckpt.dist_checkpointing.safe_globals import SAFE_GLOBALS, UnsafeCheckpointError, register_safe_globals


class Custom:
    """A user class: not on the allow-list."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Custom) and other.value == self.value


class Evil:
    """Unpickling this would run code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _save(ckpt, **common) -> None:
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(6, dtype=torch.float32).view(2, 3)),
        "v": ShardedTensor.from_rank_offsets("v", torch.ones(4, dtype=torch.float16)),
        **common,
    }
    dc.save(state, ckpt)


def _request(**overrides):
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3)),
        "v": ShardedTensor.from_rank_offsets("v", torch.empty(4, dtype=torch.float16)),
    }
    sd.update(overrides)
    return sd


def test_save_load_without_process_group(tmp_path):
    _save(tmp_path, step=3)
    assert dc.check_is_distributed_checkpoint(tmp_path)
    loaded = dc.load(_request(), tmp_path)
    assert loaded["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and loaded["step"] == 3


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(dc.CheckpointingException, match="does not exist"):
        dc.load(_request(), tmp_path / "nope")
    (tmp_path / "random.txt").write_text("hello")
    assert not dc.check_is_distributed_checkpoint(tmp_path)
    with pytest.raises(dc.CheckpointingException, match=r"is not a distributed checkpoint: .*metadata.json is missing"):
        dc.load(_request(), tmp_path)
    (tmp_path / "metadata.json").write_text("{not json")
    with pytest.raises(dc.CheckpointingException, match="metadata.json is not a valid checkpoint config"):
        dc.load_common_state_dict(tmp_path)


def test_unknown_backend(tmp_path):
    _save(tmp_path)
    config = json.loads((tmp_path / "metadata.json").read_text())
    (tmp_path / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr2"}))
    written = r"metadata.json bytes \[\d+, \d+\): the file has \d+ bytes, 119 were written"
    with pytest.raises(CorruptCheckpointError, match=written):
        dc.load(_request(), tmp_path)
    with pytest.raises(
        dc.CheckpointingException, match=r"Cannot find a default strategy for: \('load_sharded', 'zarr2', 1\)"
    ):
        dc.load(_request(), tmp_path, verify=False)


def test_missing_key_shape_and_dtype_mismatch(tmp_path):
    _save(tmp_path)
    with pytest.raises(dc.CheckpointingException, match=r"Key 'x' not found in checkpoint .*Stored tensor keys: v, w"):
        dc.load(_request(x=ShardedTensor.from_rank_offsets("x", torch.empty(1))), tmp_path)
    with pytest.raises(
        dc.CheckpointingException, match=r"Global shape mismatch for key 'w'.*stored \(2, 3\), requested \(3, 3\)"
    ):
        dc.load(_request(w=ShardedTensor.from_rank_offsets("w", torch.empty(3, 3))), tmp_path)
    with pytest.raises(
        dc.CheckpointingException, match=r"Dtype mismatch for key 'v'.*stored torch.float16, requested torch.float32"
    ):
        dc.load(_request(v=ShardedTensor.from_rank_offsets("v", torch.empty(4))), tmp_path)
    with pytest.raises(dc.CheckpointingException, match=r"ShardedObject 'o/shard_0_1' not found"):
        dc.load(_request(o=ShardedObject("o", None, (1,), (0,))), tmp_path)


def test_truncated_missing_or_corrupt_data_files(tmp_path):
    _save(tmp_path)
    path = max(tmp_path.glob("*.distcp"), key=os.path.getsize)  # the tensors' file
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    for verify in (True, False):  # found from the sizes in .metadata, before any data is read
        with pytest.raises(
            CorruptCheckpointError,
            match=rf"{path.name} bytes \[\d+, \d+\): truncated: the file has \d+ bytes, but key '\w' needs \d+",
        ):
            dc.load(_request(), tmp_path, verify=verify)
    with open(path, "wb") as f:
        f.write(b"\0" * len(data))
    with pytest.raises(CorruptCheckpointError, match=rf"{path.name} bytes \[0, \d+\): checksum mismatch"):
        dc.load(_request(), tmp_path)
    with pytest.raises(dc.CheckpointingException, match=r"Failed to read checkpoint"):
        dc.load(_request(), tmp_path, verify=False)
    os.remove(path)
    with pytest.raises(dc.CheckpointingException, match=rf"Checkpoint file .*{path.name} is missing \(needed for key"):
        dc.load(_request(), tmp_path)
    os.remove(tmp_path / ".metadata")
    with pytest.raises(
        dc.CheckpointingException, match=r"\.metadata is missing: .* is not a complete torch_dist checkpoint"
    ):
        dc.load(_request(), tmp_path)


def test_common_data_refuses_unknown_types_unless_opted_in(tmp_path):
    _save(tmp_path, cfg=Custom(5))
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"Refused to unpickle type '.*Custom' from common state file .*common.pt.*allow_unsafe_pickle=True",
    ):
        dc.load_common_state_dict(tmp_path)
    with pytest.raises(UnsafeCheckpointError):
        dc.load(_request(), tmp_path)
    assert dc.load_common_state_dict(tmp_path, allow_unsafe_pickle=True)["cfg"] == Custom(5)
    assert dc.load(_request(), tmp_path, allow_unsafe_pickle=True)["cfg"] == Custom(5)


def test_common_state_object_used_without_common_pt(tmp_path):
    """Megatron-Core 0.19 checkpoints have no common.pt: common data is the 'common_state' object."""
    _save(tmp_path, step=11, cfg=Custom(1))
    os.remove(tmp_path / "common.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"Custom' from ShardedObject 'common_state/shard_0_1'"):
        dc.load_common_state_dict(tmp_path)
    assert dc.load_common_state_dict(tmp_path, allow_unsafe_pickle=True)["step"] == 11


def test_sharded_object_refused_then_registered(tmp_path):
    dc.save({"o": ShardedObject("o", Custom(3), (1,), (0,))}, tmp_path)
    request = {"o": ShardedObject("o", None, (1,), (0,))}
    with pytest.raises(UnsafeCheckpointError, match=r"Custom' from ShardedObject 'o/shard_0_1'"):
        dc.load(request, tmp_path)
    register_safe_globals([Custom])
    try:
        assert dc.load(request, tmp_path)["o"] == Custom(3)
    finally:
        SAFE_GLOBALS.remove(Custom)


def test_malicious_pickles_are_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _save(ckpt, evil=Evil(str(marker)))
    with pytest.raises(UnsafeCheckpointError, match="builtins.open|io.open"):
        dc.load_common_state_dict(ckpt)
    assert not marker.exists()
    # a crafted DCP .metadata (of a checkpoint without checksums, which would refuse it as corrupt) is refused too
    os.remove(ckpt / CHECKSUMS_FNAME)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(Evil(str(marker)), f)
    with pytest.raises(UnsafeCheckpointError, match=r"Refused to read .*\.metadata"):
        dc.load_tensors_metadata(ckpt)
    assert not marker.exists()

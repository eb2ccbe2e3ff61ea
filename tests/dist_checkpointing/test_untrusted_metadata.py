"""A `.metadata` is checked before anything is read or allocated from it: its storage entries name files inside the
checkpoint (no absolute paths, `..`, or symbolic links leading out), do not overlap, have non-negative offsets and
lengths within their files; each tensor's chunks lie inside its size, have a storage entry large enough, and hold its
elements (so a load allocates no more than the files hold). Each malformed field raises a named error; nothing
outside the checkpoint is read. The checkpoints here have no checksums (a crafted one would be refused as corrupt)."""

import copy
import dataclasses
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.integrity import CorruptCheckpointError
from nemo_ckpt.dist_checkpointing.safe_globals import DCPMetadataUnpickler
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy


def _save(directory: Path) -> None:
    state = {
        "w": dc.ShardedTensor.from_rank_offsets("w", torch.arange(24.0).view(4, 6)),
        "v": dc.ShardedTensor.from_rank_offsets("v", torch.arange(5.0)),
        "o": dc.ShardedObject("o", {"a": 1}, (1,), (0,)),
    }
    dc.save(state, directory, TorchDistSaveShardedStrategy(thread_count=1, checksums=False))


def _entry(metadata, key: str):
    return next(index for index in metadata.storage_data if index.fqn == key)


def _relocate(name: str) -> Callable:
    def change(metadata, directory: Path) -> None:
        index = _entry(metadata, "w")
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path=name)

    return change


def _storage(key: str, **fields) -> Callable:
    def change(metadata, directory: Path) -> None:
        index = _entry(metadata, key)
        info = metadata.storage_data[index]
        values = {name: value(info) if callable(value) else value for name, value in fields.items()}
        metadata.storage_data[index] = dataclasses.replace(info, **values)

    return change


def _tensor(key: str, change_md: Callable) -> Callable:
    def change(metadata, directory: Path) -> None:
        change_md(metadata.state_dict_metadata[key])

    return change


def _link_outside(metadata, directory: Path) -> None:
    (directory / "linked.distcp").symlink_to(directory.parent / "outside.distcp")
    _relocate("linked.distcp")(metadata, directory)


def _huge(md) -> None:
    md.size = torch.Size([10**12])


def _outside_size(md) -> None:
    md.chunks[0].sizes = torch.Size([9])


def _unstored_chunk(metadata, directory: Path) -> None:
    del metadata.storage_data[_entry(metadata, "w")]


def _past_the_end(metadata, directory: Path) -> None:
    index = max(metadata.storage_data, key=lambda index: metadata.storage_data[index].offset)
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], length=2**40)


def _drop_object(metadata, directory: Path) -> None:
    del metadata.storage_data[MetadataIndex("o/shard_0_1")]


CASES = {
    "absolute path": (_relocate("/etc/passwd"), CorruptCheckpointError, "points outside the checkpoint"),
    "parent path": (_relocate("../outside.distcp"), CorruptCheckpointError, "points outside the checkpoint"),
    "link outside": (_link_outside, CorruptCheckpointError, "symbolic link that leads outside"),
    "negative offset": (_storage("w", offset=-8), dc.CheckpointingException, "has offset -8"),
    "float length": (_storage("w", length=1.5), dc.CheckpointingException, "length 1.5"),
    "overlap": (_storage("v", offset=lambda info: info.offset - 1), CorruptCheckpointError, "overlap"),
    "beyond the file": (_past_the_end, CorruptCheckpointError, "truncated: the file has"),
    "huge tensor": (_tensor("v", _huge), dc.CheckpointingException, "has chunks of 5 elements only"),
    "chunk outside": (_tensor("v", _outside_size), dc.CheckpointingException, "outside its size"),
    "item too short": (_storage("w", length=40), dc.CheckpointingException, "holds 96 bytes, its stored item 40"),
    "chunk unstored": (_unstored_chunk, dc.CheckpointingException, r"chunk at \(0, 0\) has no storage entry"),
    "dtype": (_tensor("w", lambda md: setattr(md.properties, "dtype", "float32")), dc.CheckpointingException, "dtype"),
    "object unstored": (_drop_object, dc.CheckpointingException, "object 'o/shard_0_1' has no storage entry"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_metadata_raises_a_named_error_before_reading(tmp_path, case):
    change, error, message = CASES[case]
    directory = tmp_path / "ckpt"
    directory.mkdir()
    _save(directory)
    (tmp_path / "outside.distcp").write_bytes(b"\0" * 4096)
    with open(directory / ".metadata", "rb") as f:
        metadata = copy.deepcopy(DCPMetadataUnpickler(f).load())
    metadata.storage_meta = StorageMeta()
    change(metadata, directory)
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    atime = os.stat(tmp_path / "outside.distcp").st_atime_ns
    for load in (dc.load_plain_tensors, dc.load_tensors_metadata):
        with pytest.raises(error, match=message):
            load(directory)
    assert os.stat(tmp_path / "outside.distcp").st_atime_ns == atime

"""Checksums: every file a save writes has CRC32C ranges in `checksums.json` (`metadata.json`, `.metadata`,
`common.pt`, every `.distcp`; a training checkpoint's `context/` in its own); a load checks what it reads, as it
reads it, by default, and names each corrupt file and byte range; a checkpoint we saved that lost its checksums is
refused unless verification is off; checkpoints of other tools load as before; `verify` (API and
`python -m nemo_ckpt verify`) checks every file. Fault injection across every file: test_fault_injection.py."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import cli, integrity
from nemo_ckpt.dist_checkpointing.integrity import (
    CHECKSUMS_FNAME,
    CorruptCheckpointError,
    MissingChecksumsError,
    read_verified,
    verify_checkpoint,
    write_checksums,
    write_directory_checksums,
)
from nemo_ckpt.dist_checkpointing.safe_globals import DCPMetadataUnpickler
from nemo_ckpt.dist_checkpointing.strategies import fast_reader
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions

FIXTURE_0_15 = Path(__file__).parent / "fixtures" / "mcore_0_15_3"
BLOCK = 4096  # checksum block of the tests' saves (8 MiB by default)


def state(template: bool = False) -> dict:
    def tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> dc.ShardedTensor:
        data = (
            torch.zeros(shape, dtype=dtype)
            if template
            else torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        )
        return dc.ShardedTensor.from_rank_offsets(key, data)

    return {
        "w": tensor("decoder.w", (64, 32), torch.float32, 0),
        "b": tensor("decoder.b", (96,), torch.bfloat16, 1),
        "exp_avg": tensor("optimizer.exp_avg", (64, 32), torch.float32, 2),
        "rng": dc.ShardedObject("rng", None if template else {"seed": 7}, (1,), (0,)),
        "step": 3,
    }


def save(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`state()` saved with 4 KiB checksum blocks, tensors of 1 KiB or more in ranges of their own."""
    monkeypatch.setattr(integrity, "CHECKSUM_BLOCK", BLOCK)
    monkeypatch.setattr(integrity, "LARGE_PIECE", 1024)
    directory.mkdir(exist_ok=True)
    dc.save(state(), directory, TorchDistSaveShardedStrategy(thread_count=2))
    return directory


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(raw)


def test_checksums_cover_every_written_file(tmp_path, monkeypatch, capsys):
    directory = save(tmp_path, monkeypatch)
    document = json.loads((directory / CHECKSUMS_FNAME).read_text())
    files = document["files"]
    assert set(files) == {".metadata", "common.pt", "metadata.json", "__0_0.distcp", "__0_1.distcp"}
    assert set(p.name for p in directory.iterdir()) == set(files) | {CHECKSUMS_FNAME}
    for name, ranges in files.items():  # ranges tile each file
        assert [offset for offset, _, _ in ranges] == [0] + [o + n for o, n, _ in ranges[:-1]]
        assert sum(n for _, n, _ in ranges) == (directory / name).stat().st_size
    # a tensor's bytes (8 KiB) lie in ranges of their own, split where the file's 4 KiB blocks start
    name, data = _data_ranges(directory, "decoder.w")
    assert len(data) == 3 and all((o + n) % BLOCK == 0 for o, n in data[:-1])
    assert verify_checkpoint(directory) == []
    assert cli.main(["verify", str(directory)]) == 0
    assert "intact" in capsys.readouterr().out
    loaded = dc.load(state(True), directory)
    assert loaded["rng"] == {"seed": 7} and torch.equal(loaded["w"], state()["w"].data)


def test_a_load_reads_each_byte_once_and_checks_it(tmp_path, monkeypatch):
    """The CRCs come from the reads themselves: no data byte is read twice, only the zip records around the
    tensors (the checksum ranges the reads did not cover) are read for their checksums."""
    directory = save(tmp_path, monkeypatch)
    streamed, extra = [], []
    read, gap_crc = fast_reader._pread_all, integrity.FileVerifier._gap_crc

    def record_read(fd: int, view: memoryview, offset: int) -> None:
        streamed.append(view.nbytes)
        read(fd, view, offset)

    def record_gap(self, fd, kept, start: int, end: int) -> int:
        if self._kept_slice(kept, start, end) is None:
            extra.append(end - start)
        return gap_crc(self, fd, kept, start, end)

    monkeypatch.setattr(fast_reader, "_pread_all", record_read)
    monkeypatch.setattr(integrity.FileVerifier, "_gap_crc", record_gap)
    dc.load(state(True), directory)
    assert sum(streamed) == (64 * 32 * 4) * 2 + 96 * 2  # every tensor byte once
    assert sum(extra) < 4 * 4096  # zip records beyond the 4 KiB read at each end of an item


def test_part_of_a_tensor_is_checked_by_its_blocks(tmp_path, monkeypatch):
    directory = save(tmp_path, monkeypatch)
    rows = {"w": dc.ShardedTensor("decoder.w", torch.zeros(8, 32), torch.float32, (8, 32), (64, 32), (40, 0), None)}
    assert torch.equal(dc.load(rows, directory, validate_access_integrity=False)["w"], state()["w"].data[40:48])
    name, data = _data_ranges(directory, "decoder.w")
    flip(directory / name, data[0][0] + 100)  # the first rows, which this request does not read: not checked
    assert torch.equal(dc.load(rows, directory, validate_access_integrity=False)["w"], state()["w"].data[40:48])
    with pytest.raises(CorruptCheckpointError, match=rf"{name} bytes \[\d+, \d+\): checksum mismatch"):
        dc.load(state(True), directory)


def _item(directory: Path, key: str) -> tuple[str, int]:
    """The file and offset of the stored item of `key`."""
    with open(directory / ".metadata", "rb") as f:
        metadata = DCPMetadataUnpickler(f).load()
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == key)
    return info.relative_path, info.offset


def _data_ranges(directory: Path, key: str, nbytes: int = 64 * 32 * 4) -> tuple[str, list[tuple[int, int]]]:
    """The file and checksum ranges (offset, length) of the `nbytes` bytes of tensor `key` (saved by `save`: the
    first range of 1 KiB or more in its item, and those after it)."""
    name, item = _item(directory, key)
    ranges = json.loads((directory / CHECKSUMS_FNAME).read_text())["files"][name]
    first = next(i for i, (o, n, _) in enumerate(ranges) if o >= item and n >= 1024)
    data = []
    while sum(n for _, n in data) < nbytes:
        data.append(tuple(ranges[first + len(data)][:2]))
    return name, data


def test_corrupt_bytes_raise_a_named_error_before_anything_is_returned(tmp_path, monkeypatch):
    directory = save(tmp_path, monkeypatch)
    name, item = _item(directory, "decoder.w")
    flip(directory / name, item + 5000)
    template = state(True)
    with pytest.raises(CorruptCheckpointError) as raised:
        dc.load(template, directory)
    (corruption,) = raised.value.corruptions
    assert corruption.file == name and corruption.start <= item + 5000 < corruption.stop
    assert "checksum mismatch (stored" in str(raised.value) and "Nothing of it was used" in str(raised.value)
    assert torch.equal(dc.load(state(True), directory, verify=False)["b"], state()["b"].data)  # the flag


def test_a_sharded_object_is_checked_before_it_is_unpickled(tmp_path, monkeypatch):
    directory = save(tmp_path, monkeypatch)
    name, item = _item(directory, "rng/shard_0_1")
    flip(directory / name, item + 40)
    unpickled = []
    monkeypatch.setattr("nemo_ckpt.dist_checkpointing.strategies.torch.safe_torch_load", unpickled.append)
    with pytest.raises(CorruptCheckpointError, match=name):
        dc.load({"rng": state(True)["rng"]}, directory)
    assert unpickled == []


def test_checkpoints_with_one_range_per_item_still_verify(tmp_path, monkeypatch):
    """Checkpoints saved before tensors had ranges of their own: a range is checked from the reads inside it,
    combined (crc32c_combine), and the bytes around them."""
    directory = save(tmp_path, monkeypatch)
    with open(directory / ".metadata", "rb") as f:
        metadata = DCPMetadataUnpickler(f).load()
    files = json.loads((directory / CHECKSUMS_FNAME).read_text())["files"]
    for name in [n for n in files if n.endswith(".distcp")]:
        data = (directory / name).read_bytes()
        items = sorted((i.offset, i.length) for i in metadata.storage_data.values() if i.relative_path == name)
        files[name] = [[o, n, integrity.extend(0, data[o : o + n])] for o, n in items]
    write_checksums(directory, files)
    assert verify_checkpoint(directory) == []
    assert torch.equal(dc.load(state(True), directory)["exp_avg"], state()["exp_avg"].data)
    name, item = _item(directory, "optimizer.exp_avg")
    flip(directory / name, item + 6000)
    with pytest.raises(CorruptCheckpointError, match=rf"{name} bytes \[{item}, \d+\): checksum mismatch"):
        dc.load(state(True), directory)


def test_a_damaged_checksums_file_is_named(tmp_path, monkeypatch):
    directory = save(tmp_path, monkeypatch)
    document = json.loads((directory / CHECKSUMS_FNAME).read_text())
    document["files"]["__0_0.distcp"][0][2] ^= 1
    (directory / CHECKSUMS_FNAME).write_text(json.dumps(document))
    with pytest.raises(CorruptCheckpointError, match="checksums.json .*its own checksum does not match"):
        dc.load(state(True), directory)
    assert cli.main(["verify", str(directory)]) == 1


def test_a_checkpoint_that_lost_its_checksums_is_refused_unless_verification_is_off(tmp_path, monkeypatch, capsys):
    directory = save(tmp_path, monkeypatch)
    os.remove(directory / CHECKSUMS_FNAME)
    for load in (
        lambda: dc.load(state(True), directory),
        lambda: dc.load_common_state_dict(directory),
        lambda: dc.load_tensors_metadata(directory),
    ):
        with pytest.raises(
            MissingChecksumsError, match=r"checksums.json is missing .*verify=False .*ckpt_verify_on_load"
        ):
            load()
    assert cli.main(["verify", str(directory)]) == 1
    assert "was saved with checksums, but" in capsys.readouterr().err
    assert dc.load(state(True), directory, verify=False)["step"] == 3
    assert dc.load_common_state_dict(directory, verify=False)["step"] == 3


def test_checkpoints_of_other_tools_load_and_verify_says_they_have_no_checksums(tmp_path, capsys):
    assert verify_checkpoint(FIXTURE_0_15) is None
    assert cli.main(["verify", str(FIXTURE_0_15)]) == 2 and "no checksums" in capsys.readouterr().out
    assert dc.load_plain_tensors(FIXTURE_0_15)["decoder.w"].shape == (8, 6)
    loaded = dc.load({"w": dc.ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(8, 6))}, FIXTURE_0_15)
    assert loaded["w"].sum() > 0
    # ours saved without checksums (the strategy's option) is such a checkpoint too
    dc.save(state(), tmp_path, TorchDistSaveShardedStrategy(checksums=False))
    assert not (tmp_path / CHECKSUMS_FNAME).exists() and verify_checkpoint(tmp_path) is None
    assert dc.load(state(True), tmp_path)["rng"] == {"seed": 7}


def test_a_nemo_checkpoint_loads_unverified_as_a_resume_does(tmp_path, capsys):
    """NeMo's layout: Megatron-Core's weights in `weights/`, its own configs in `context/`, no checksums."""
    shutil.copytree(FIXTURE_0_15, tmp_path / "weights")
    (tmp_path / "context").mkdir()
    (tmp_path / "context" / "io.json").write_text("{}")
    template = {"w": dc.ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(8, 6))}
    assert DistCheckpointIO().load_checkpoint(tmp_path, sharded_state_dict=template)["w"].sum() > 0
    assert cli.main(["verify", str(tmp_path)]) == 2 and "NeMo" in capsys.readouterr().out


def test_verify_names_a_symlink_loop_and_a_dangling_link(tmp_path, capsys):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name, message in {
        "loop": "is a symbolic link loop",
        "dangling": "is a symbolic link to a missing path",
    }.items():
        assert cli.main(["verify", str(tmp_path / name)]) == 1
        assert f"error: {tmp_path / name} {message}" in capsys.readouterr().err
    with pytest.raises(dc.CheckpointingException, match="is a symbolic link loop"):
        dc.load(state(True), tmp_path / "loop")


def test_checksums_naming_a_file_outside_the_checkpoint_are_corrupt(tmp_path, monkeypatch):
    directory = save(tmp_path / "ckpt", monkeypatch)
    (tmp_path / "secret").write_bytes(b"x" * 10)
    for name in ("../secret", "/etc/passwd"):
        write_checksums(directory, {name: [[0, 10, 0]]})
        corruptions = verify_checkpoint(directory)
        assert [c.file for c in corruptions] == [CHECKSUMS_FNAME] and "outside" in corruptions[0].reason
    (directory / "link").symlink_to(tmp_path / "secret")
    write_checksums(directory, {"link": [[0, 10, 0]]})
    assert "symbolic link that leads outside" in verify_checkpoint(directory)[0].reason


def _training_checkpoint(path: Path, monkeypatch: pytest.MonkeyPatch, **options) -> DistCheckpointIO:
    """A training checkpoint: weights by DistCheckpointIO, a `context/` with its checksums as ModelCheckpoint writes."""
    monkeypatch.setattr(integrity, "CHECKSUM_BLOCK", BLOCK)
    io = DistCheckpointIO(DistCheckpointOptions(**options))
    io.save_checkpoint(state(), path)
    io.teardown()
    (path / "context" / "hf").mkdir(parents=True)
    (path / "context" / "model.json").write_text('{"hidden_size": 64}')
    (path / "context" / "hf" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    write_directory_checksums(path / "context")
    return io


def test_training_checkpoint_context_is_checked_by_the_load_and_verify(tmp_path, monkeypatch, capsys):
    io = _training_checkpoint(tmp_path, monkeypatch, ckpt_async_save=True)
    assert set(json.loads((tmp_path / "context" / CHECKSUMS_FNAME).read_text())["files"]) == {
        "model.json",
        "hf/tokenizer_config.json",
    }
    assert cli.main(["verify", str(tmp_path)]) == 0
    assert io.load_checkpoint(tmp_path, sharded_state_dict=state(True))["rng"] == {"seed": 7}
    assert read_verified(tmp_path / "context", "model.json", required=True) == b'{"hidden_size": 64}'
    (tmp_path / "context" / "model.json").write_text('{"hidden_size": 65}')
    with pytest.raises(CorruptCheckpointError, match=r"model.json bytes \[0, 19\): checksum mismatch"):
        io.load_checkpoint(tmp_path, sharded_state_dict=state(True))
    with pytest.raises(CorruptCheckpointError, match="model.json"):  # what a reader of context/ calls
        read_verified(tmp_path / "context", "model.json", required=True)
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert f"CORRUPT {tmp_path / 'context' / 'model.json'}: bytes [0, 19)" in capsys.readouterr().out
    os.remove(tmp_path / "context" / CHECKSUMS_FNAME)
    with pytest.raises(MissingChecksumsError, match="context"):
        io.load_checkpoint(tmp_path, sharded_state_dict=state(True))
    with pytest.raises(MissingChecksumsError, match="context"):
        read_verified(tmp_path / "context", "model.json", required=True)
    unverified = DistCheckpointIO(DistCheckpointOptions(ckpt_verify_on_load=False))
    assert unverified.load_checkpoint(tmp_path, sharded_state_dict=state(True))["step"] == 3


def test_async_save_is_verified_by_default(tmp_path, monkeypatch):
    io = _training_checkpoint(tmp_path, monkeypatch, ckpt_async_save=True)
    assert DistCheckpointOptions().ckpt_verify_on_load
    assert verify_checkpoint(tmp_path / "weights") == []
    data = tmp_path / "weights" / "__0_0.distcp"
    flip(data, data.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0.distcp bytes \[\d+, \d+\): checksum mismatch"):
        io.load_checkpoint(tmp_path, sharded_state_dict=state(True))


def test_a_copy_without_checksums_of_an_old_checkpoint_loads(tmp_path, monkeypatch):
    """Checkpoints of ours saved before `.metadata` was marked carry no marker: without checksums they load as
    another tool's do."""
    directory = save(tmp_path / "ckpt", monkeypatch)
    raw = (directory / ".metadata").read_bytes().replace(integrity.CHECKSUMS_MARKER.encode(), b"x" * 20)
    (directory / ".metadata").write_bytes(raw)
    os.remove(directory / CHECKSUMS_FNAME)
    assert verify_checkpoint(directory) is None
    assert dc.load(state(True), directory)["rng"] == {"seed": 7}
    shutil.rmtree(directory)

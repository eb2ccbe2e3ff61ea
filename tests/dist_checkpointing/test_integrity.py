"""Checksums: every written file's items get a CRC32C at save, `verify` (API and `python -m nemo_ckpt verify`)
and `load(verify=True)` name each corrupt file and byte range; fault injection (random byte flips and
truncations) is always detected; checkpoints saved without checksums still load."""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import cli
from nemo_ckpt.dist_checkpointing.integrity import CHECKSUMS_FNAME, CorruptCheckpointError, verify_checkpoint
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions

FIXTURE_0_15 = Path(__file__).parent / "fixtures" / "mcore_0_15_3"


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


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pristine")
    dc.save(state(), directory, TorchDistSaveShardedStrategy(thread_count=2))
    return directory


def test_checksums_cover_every_written_byte(pristine, capsys):
    files = json.loads((pristine / CHECKSUMS_FNAME).read_text())["files"]
    assert set(files) == {".metadata", "common.pt", "__0_0.distcp", "__0_1.distcp"}
    for name, ranges in files.items():  # item ranges tile each file
        assert [offset for offset, _, _ in ranges] == [0] + [o + n for o, n, _ in ranges[:-1]]
        assert sum(n for _, n, _ in ranges) == (pristine / name).stat().st_size
    assert verify_checkpoint(pristine) == []
    assert cli.main(["verify", str(pristine)]) == 0
    assert "intact" in capsys.readouterr().out
    assert dc.load(state(True), pristine, verify=True)["rng"] == {"seed": 7}


def test_checkpoint_without_checksums_loads_and_verify_says_so(tmp_path, capsys):
    assert verify_checkpoint(FIXTURE_0_15) is None
    assert cli.main(["verify", str(FIXTURE_0_15)]) == 2 and "no checksums" in capsys.readouterr().out
    assert dc.load_plain_tensors(FIXTURE_0_15)["decoder.w"].shape == (8, 6)
    loaded = dc.load(
        {"w": dc.ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(8, 6))}, FIXTURE_0_15, verify=True
    )
    assert loaded["w"].sum() > 0


def test_async_save_checksums_and_verify_on_load(tmp_path):
    io = DistCheckpointIO(DistCheckpointOptions(ckpt_async_save=True, ckpt_verify_on_load=True))
    io.save_checkpoint(state(), tmp_path)
    io.teardown()
    assert verify_checkpoint(tmp_path / "weights") == []
    data = tmp_path / "weights" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0.distcp bytes \[\d+, \d+\): checksum mismatch"):
        io.load_checkpoint(tmp_path, sharded_state_dict=state(True))


def _corrupt(directory: Path, rng: random.Random, truncate: bool) -> tuple[str, int]:
    """Flip one random bit of a random byte (or cut the file at a random length) of a random file."""
    name = rng.choice(sorted(p.name for p in directory.iterdir() if p.name != "metadata.json"))
    path = directory / name
    raw = bytearray(path.read_bytes())
    offset = rng.randrange(len(raw))
    if truncate:
        path.write_bytes(raw[:offset])
    else:
        raw[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(raw)
    return name, offset


@pytest.mark.parametrize(("truncate", "cases"), [(False, 200), (True, 50)], ids=["byte_flips", "truncations"])
def test_fault_injection_is_detected_and_named(pristine, tmp_path, truncate, cases):
    rng = random.Random(13)
    expected = dc.load(state(True), pristine)
    tally = {"load raised": 0, "loaded wrong values": 0, "loaded identical": 0}
    for case in range(cases):
        directory = tmp_path / f"case{case}"
        shutil.copytree(pristine, directory)
        name, offset = _corrupt(directory, rng, truncate)
        where = f"case {case}: {'truncated' if truncate else 'flipped'} {name} at {offset}"

        try:
            corruptions = verify_checkpoint(directory)
        except CorruptCheckpointError as error:  # checksums.json itself no longer parses
            corruptions = error.corruptions
        assert corruptions, where
        if name != CHECKSUMS_FNAME:
            assert any(c.file == name and c.start <= offset < c.stop for c in corruptions), (where, corruptions)
        with pytest.raises(CorruptCheckpointError):
            dc.load(state(True), directory, verify=True)

        try:  # without verification: a clear error, or values that `verify` reported above
            loaded = dc.load(state(True), directory)
        except (dc.CheckpointingException, ValueError, RuntimeError) as error:
            assert str(error), where
            tally["load raised"] += 1
        else:
            same = (
                all(torch.equal(loaded[k], expected[k]) for k in ("w", "b", "exp_avg"))
                and loaded["rng"] == expected["rng"]
            )
            tally["loaded identical" if same else "loaded wrong values"] += 1
        shutil.rmtree(directory)
    print(f"fault injection ({'truncations' if truncate else 'byte flips'}): {cases} detected by verify; {tally}")

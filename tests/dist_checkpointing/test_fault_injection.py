"""Fault injection with the defaults: bytes flipped at 100+ positions spread over every file of a small training
checkpoint (`weights/`: every `.distcp`, `.metadata`, `metadata.json`, `common.pt`, `checksums.json`; `context/`:
its configs, tokenizer files and `checksums.json`) and every file truncated at 3 lengths; each case is loaded as a
resume does (`DistCheckpointIO.load_checkpoint`, default options) and must raise a named error
(`CheckpointingException`) or give values bit-identical to the original: no silently wrong value. A few cases on 2
ranks: a file only one rank reads stops both (no rank goes on, none waits forever)."""

import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.checkpoint.context import save_context
from nemo_ckpt.data.tokenizer import ByteLevelTokenizer
from nemo_ckpt.dist_checkpointing import integrity
from nemo_ckpt.dist_checkpointing.integrity import write_directory_checksums
from nemo_ckpt.models import GPTModel, gpt_config
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions
from tests.helpers.distributed import run_distributed

FLIPS_PER_FILE = 8  # and one more per 4 KiB of the file, at most 24
TRUNCATIONS_PER_FILE = 3


def state(template: bool = False, rank: int = 0, world_size: int = 1) -> dict:
    def tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> dc.ShardedTensor:
        rows = shape[0] // world_size
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        data = full[rank * rows : (rank + 1) * rows].clone()
        return dc.ShardedTensor.from_rank_offsets(
            key, torch.zeros_like(data) if template else data, (0, rank, world_size)
        )

    return {
        "state_dict": {
            "module.w": tensor("module.w", (64, 32), torch.float32, 0),
            "module.b": tensor("module.b", (96,), torch.bfloat16, 1),
            "module.big": tensor("module.big", (256, 64), torch.float32, 2),
        },
        "optimizer_states": {"exp_avg": tensor("optimizer.exp_avg", (64, 32), torch.float32, 3)},
        "rng": dc.ShardedObject("rng", None if template else {"seed": 7 + rank}, (world_size,), (rank,)),
        "global_step": 11,
    }


def identical(loaded: object, expected: object) -> bool:
    """Bit-identical values (tensors compared byte for byte)."""
    if isinstance(expected, torch.Tensor):
        return isinstance(loaded, torch.Tensor) and torch.equal(
            loaded.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8)
        )
    if isinstance(expected, dict):
        return isinstance(loaded, dict) and loaded.keys() == expected.keys()
    return loaded == expected


def values(checkpoint: dict) -> dict:
    return {
        "w": checkpoint["state_dict"]["module.w"],
        "b": checkpoint["state_dict"]["module.b"],
        "big": checkpoint["state_dict"]["module.big"],
        "exp_avg": checkpoint["optimizer_states"]["exp_avg"],
        "rng": checkpoint["rng"],
        "step": checkpoint["global_step"],
    }


def save_training_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> None:
    """Weights as a training save writes them (4 KiB checksum blocks, so tensors span several), `context/` as
    ModelCheckpoint writes it (configs, tokenizer, then their checksums)."""
    io = DistCheckpointIO()
    io.save_checkpoint(state(rank=rank, world_size=world_size), path)
    if rank == 0:
        save_context(path, model=GPTModel(gpt_config("tiny")), data=SimpleNamespace(tokenizer=ByteLevelTokenizer()))
        write_directory_checksums(path / "context")


def load(path: Path, **options) -> dict:
    return DistCheckpointIO(DistCheckpointOptions(**options)).load_checkpoint(path, sharded_state_dict=state(True))


def outcome(path: Path, expected: dict) -> str:
    try:
        loaded = values(load(path))
    except dc.CheckpointingException as error:
        return type(error).__name__
    return "identical" if all(identical(loaded[k], v) for k, v in expected.items()) else "WRONG VALUES"


def cases(checkpoint: Path, seed: int) -> list[tuple[str, str, int]]:
    """(kind, file, position): flips spread over each file (evenly, then at random), truncations of each file to
    nothing, half and all but its last byte."""
    rng = random.Random(seed)
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    found = []
    for path in files:
        size = path.stat().st_size
        count = min(24, FLIPS_PER_FILE + size // 4096)
        positions = sorted({i * size // count for i in range(count // 2)} | {rng.randrange(size) for _ in range(count)})
        found += [("flip", str(path.relative_to(checkpoint)), position) for position in positions]
        found += [("truncate", str(path.relative_to(checkpoint)), n) for n in (0, size // 2, size - 1)]
    return found


def inject(path: Path, kind: str, position: int) -> bytes:
    """Apply the fault; return the file's original bytes."""
    original = path.read_bytes()
    if kind == "flip":
        raw = bytearray(original)
        raw[position] ^= 1 << (position % 8)
        path.write_bytes(raw)
    else:
        path.write_bytes(original[:position])
    return original


def test_every_fault_raises_a_named_error_or_loads_the_original_values(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(integrity, "CHECKSUM_BLOCK", 4096)
    checkpoint = tmp_path / "step=11"
    save_training_checkpoint(checkpoint)
    expected = values(load(checkpoint))
    tally: dict[str, Counter] = {"flip": Counter(), "truncate": Counter()}
    files: dict[str, Counter] = {}
    wrong = []
    for kind, name, position in cases(checkpoint, seed=45):
        path = checkpoint / name
        original = inject(path, kind, position)
        try:
            result = outcome(checkpoint, expected)
        finally:
            path.write_bytes(original)
        tally[kind][result] += 1
        files.setdefault(name, Counter())[result] += 1
        if result == "WRONG VALUES":
            wrong.append((kind, name, position))
    assert wrong == []
    assert sum(tally["flip"].values()) >= 100 and sum(tally["truncate"].values()) >= 30
    assert {name.split("/")[0] for name in files} == {"weights", "context"} and len(files) >= 10
    with capsys.disabled():
        print(
            f"\nfault injection, {len(files)} files: flips {dict(tally['flip'])}, truncations {dict(tally['truncate'])}"
        )
        for name, counts in sorted(files.items()):
            print(f"  {name}: {dict(counts)}")


def _two_ranks(rank: int, world_size: int, root: str, faults: list[tuple[str, str, int]], parallel: bool) -> list:
    checkpoint = Path(root)
    if not (checkpoint / "weights" / "metadata.json").exists():
        save_training_checkpoint(checkpoint, rank, world_size)
    expected = values(state(rank=rank, world_size=world_size))
    results = []
    for kind, name, position in faults:
        torch.distributed.barrier()
        original = inject(checkpoint / name, kind, position) if rank == 0 else None
        torch.distributed.barrier()
        template = state(True, rank, world_size)
        io = DistCheckpointIO(DistCheckpointOptions(ckpt_parallel_load=parallel))
        try:
            loaded = values(io.load_checkpoint(checkpoint, sharded_state_dict=template))
            results.append("identical" if all(identical(loaded[k], v) for k, v in expected.items()) else "WRONG")
        except dc.CheckpointingException as error:
            results.append(type(error).__name__)
        torch.distributed.barrier()
        if rank == 0:
            (checkpoint / name).write_bytes(original)
    return results


@pytest.mark.parametrize("parallel", [False, True], ids=["each rank reads its own", "parallel load"])
def test_on_two_ranks_a_fault_one_rank_reads_stops_both(tmp_path, parallel):
    faults = [
        ("flip", "weights/__1_0.distcp", 6000),  # rank 1's rows of a tensor
        ("flip", "weights/__0_0.distcp", 6000),
        ("truncate", "weights/__1_1.distcp", 100),
        ("flip", "weights/common.pt", 30),
        ("flip", "context/model.json", 10),
    ]
    per_rank = run_distributed(_two_ranks, 2, str(tmp_path / "ckpt"), faults, parallel)
    for fault, results in zip(faults, zip(*per_rank)):
        assert all(result.endswith(("Error", "Exception")) for result in results), (fault, results)

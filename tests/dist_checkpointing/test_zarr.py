"""Legacy zarr checkpoints (Megatron-Core's deprecated format): load them, and convert them to torch_dist."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.converter import convert_zarr_to_torch_dist, main
from nemo_ckpt.dist_checkpointing.core import CheckpointingConfig, save_config

zarr = pytest.importorskip("zarr")

WEIGHT = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
EMBED = (torch.arange(4 * 3, dtype=torch.float32) / 8).to(torch.bfloat16).view(4, 3)


def write_legacy_zarr(directory: Path) -> None:
    """A checkpoint as Megatron-Core's zarr strategy wrote it from 2 ranks (rows split), plus common.pt."""
    weight = zarr.create_array(
        store=str(directory / "decoder.weight"),
        shape=(8, 6),
        chunks=(4, 6),
        dtype="<f4",
        zarr_format=2,
        compressors=None,
        fill_value=None,
    )
    weight[0:4], weight[4:8] = WEIGHT[0:4].numpy(), WEIGHT[4:8].numpy()
    embed_path = directory / "embedding.weight"
    embed = zarr.create_array(
        store=str(embed_path),
        shape=(4, 3),
        chunks=(2, 3),
        dtype="<u2",
        zarr_format=2,
        compressors=None,
        fill_value=None,
    )
    embed[:] = EMBED.view(torch.int16).numpy().view(np.uint16)
    zarray = json.loads((embed_path / ".zarray").read_text())
    zarray["dtype"] = "bfloat16"  # as Megatron-Core patched it
    (embed_path / ".zarray").write_text(json.dumps(zarray))
    torch.save({"iteration": 7, "args": {"lr": 0.1}}, directory / "common.pt")
    save_config(CheckpointingConfig("zarr", 1, "torch", 1), directory)


def template(rank: int, world_size: int) -> dict:
    return {
        "weight": dc.ShardedTensor.from_rank_offsets(
            "decoder.weight", torch.zeros(8 // world_size, 6), (0, rank, world_size)
        ),
        "embedding": dc.ShardedTensor.from_rank_offsets("embedding.weight", torch.zeros(4, 3, dtype=torch.bfloat16)),
    }


def test_load_legacy_zarr_resharded(tmp_path):
    write_legacy_zarr(tmp_path)
    loaded = dc.load(template(0, 1), tmp_path)
    assert torch.equal(loaded["weight"], WEIGHT) and torch.equal(loaded["embedding"], EMBED)
    assert loaded["iteration"] == 7
    metadata = dc.load_tensors_metadata(tmp_path)
    assert metadata["embedding.weight"].dtype == torch.bfloat16 and metadata["decoder.weight"].global_shape == (8, 6)


def test_missing_array_names_the_key(tmp_path):
    write_legacy_zarr(tmp_path)
    sharded = {"gone": dc.ShardedTensor.from_rank_offsets("gone", torch.zeros(2))}
    with pytest.raises(dc.CheckpointingException, match="gone"):
        dc.load(sharded, tmp_path)


def test_converter_writes_an_equivalent_torch_dist_checkpoint(tmp_path):
    source, target = tmp_path / "zarr", tmp_path / "torch_dist"
    source.mkdir()
    write_legacy_zarr(source)
    main([str(source), str(target)])
    assert json.loads((target / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    for rank in range(2):
        loaded = dc.load(template(rank, 2), target, validate_access_integrity=False)
        assert torch.equal(loaded["weight"], WEIGHT.chunk(2)[rank]) and torch.equal(loaded["embedding"], EMBED)
        assert loaded["iteration"] == 7 and loaded["args"] == {"lr": 0.1}


def test_converter_refuses_a_non_zarr_checkpoint(tmp_path):
    dc.save({"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path)
    with pytest.raises(dc.CheckpointingException, match="not a zarr checkpoint"):
        convert_zarr_to_torch_dist(tmp_path, tmp_path / "out")

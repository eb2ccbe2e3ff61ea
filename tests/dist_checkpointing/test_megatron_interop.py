"""On-disk compatibility with megatron-core's torch_dist format, both directions: the API surface (common state,
content metadata, sharded objects, flat optimizer shards) on a small state. A GPT + Adam state against every
installed version is in test_megatron_gpt_checkpoints.py.

Runs against megatron-core 0.19.2 as `tests/install_megatron_core.sh` installs it (as CI does); skipped without it.
"""

import torch

from tests.helpers.megatron import importorskip_megatron_core

importorskip_megatron_core("megatron.core.dist_checkpointing")

from nemo_ckpt import dist_checkpointing as ours  # noqa: E402
from nemo_ckpt.dist_checkpointing import cli  # noqa: E402
from nemo_ckpt.dist_checkpointing.integrity import verify_checkpoint  # noqa: E402
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

FULL = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
LAYERS = torch.arange(4 * 3, dtype=torch.bfloat16).view(4, 3)


def _megatron():
    return importorskip_megatron_core("megatron.core.dist_checkpointing")


def _state(lib, rank: int, ws: int, template: bool) -> dict:
    rows = 8 // ws
    return {
        "w": lib.ShardedTensor.from_rank_offsets(
            "decoder.w",
            torch.empty(rows, 6) if template else FULL[rank * rows : (rank + 1) * rows].clone(),
            (0, rank, ws),
        ),
        "layers": [
            lib.ShardedTensor.from_rank_offsets(
                "decoder.layers",
                torch.empty(3, dtype=torch.bfloat16) if template else LAYERS[i].clone(),
                (0, i, 4),
                prepend_axis_num=1,
            )
            for i in range(rank, 4, ws)
        ],
        "rng": lib.ShardedObject("rng", None if template else {"rank": rank}, (ws,), (rank,)),
    }


def _megatron_save(rank: int, ws: int, ckpt: str) -> None:
    mdc = _megatron()
    state = _state(mdc, rank, ws, template=False)
    state["iteration"] = 7
    mdc.save(state, ckpt, content_metadata={"by": "megatron"})


def _ours_load(rank: int, ws: int, ckpt: str, saved_ws: int) -> None:
    state = _state(ours, rank, ws, template=True)
    state["rng"] = [ours.ShardedObject("rng", None, (saved_ws,), (i,)) for i in range(rank, saved_ws, ws)]
    loaded = ours.load(state, ckpt)
    rows = 8 // ws
    assert torch.equal(loaded["w"], FULL[rank * rows : (rank + 1) * rows])
    assert [t.tolist() for t in loaded["layers"]] == [LAYERS[i].tolist() for i in range(rank, 4, ws)]
    assert loaded.get("rng", []) == [{"rank": i} for i in range(rank, saved_ws, ws)]  # an empty request list is dropped
    assert loaded["iteration"] == 7


def test_megatron_checkpoint_loads_here_at_any_world_size(tmp_path):
    run_distributed(_megatron_save, 2, str(tmp_path))
    assert not (tmp_path / "common.pt").exists()  # 0.19 keeps common data in the 'common_state' object
    assert verify_checkpoint(tmp_path) is None  # recognised as another tool's: no checksums, loads unverified
    assert cli.main(["verify", str(tmp_path)]) == 2
    assert ours.load_common_state_dict(tmp_path)["iteration"] == 7
    assert ours.load_content_metadata(tmp_path) == {"by": "megatron"}
    assert torch.equal(ours.load_plain_tensors(tmp_path)["decoder.w"], FULL)
    _ours_load(0, 1, str(tmp_path), 2)  # world size 1, this process
    run_distributed(_ours_load, 4, str(tmp_path), 2)


def _ours_save(rank: int, ws: int, ckpt: str) -> None:
    state = _state(ours, rank, ws, template=False)
    state["rng"] = ours.ShardedObject("rng", {"rank": rank}, (ws,), (rank,))
    # a distributed-optimizer flat shard stored as plain boxes (not reformulated for megatron-core 0.15), so
    # megatron-core 0.19 reads it as a tensor
    flat = FULL.flatten()
    bounds = [0, 5, 48] if ws == 2 else [0, 48]
    state["flat"] = ours.ShardedTensor.from_rank_offsets_flat(
        "optimizer.flat",
        flat[bounds[rank] : bounds[rank + 1]].clone(),
        (8, 6),
        flattened_range=slice(bounds[rank], bounds[rank + 1]),
    )
    state["iteration"] = 9
    strategy = TorchDistSaveShardedStrategy(reformulate_flattened=False)
    ours.save(state, ckpt, strategy, content_metadata={"by": "nemo_ckpt"})


def _megatron_load(rank: int, ws: int, ckpt: str, saved_ws: int) -> None:
    mdc = _megatron()
    state = _state(mdc, rank, ws, template=True)
    state["rng"] = [mdc.ShardedObject("rng", None, (saved_ws,), (i,)) for i in range(rank, saved_ws, ws)]
    state["flat"] = mdc.ShardedTensor.from_rank_offsets("optimizer.flat", torch.empty(8 // ws, 6), (0, rank, ws))
    loaded = mdc.load(state, ckpt)
    rows = 8 // ws
    assert torch.equal(loaded["w"], FULL[rank * rows : (rank + 1) * rows])
    assert torch.equal(loaded["flat"], FULL[rank * rows : (rank + 1) * rows])
    assert [t.tolist() for t in loaded["layers"]] == [LAYERS[i].tolist() for i in range(rank, 4, ws)]
    assert loaded.get("rng", []) == [{"rank": i} for i in range(rank, saved_ws, ws)]  # an empty request list is dropped
    assert loaded["iteration"] == 9
    assert mdc.load_content_metadata(ckpt) == {"by": "nemo_ckpt"}
    assert mdc.load_tensors_metadata(ckpt)["optimizer.flat"].global_shape == (8, 6)


def test_our_checkpoint_loads_in_megatron(tmp_path):
    run_distributed(_ours_save, 2, str(tmp_path))
    run_distributed(_megatron_load, 1, str(tmp_path), 2)
    run_distributed(_megatron_load, 4, str(tmp_path), 2)
    # megatron-core 0.15-0.18 read only common.pt: it must hold the common dict
    assert torch.load(tmp_path / "common.pt", weights_only=True)["iteration"] == 9

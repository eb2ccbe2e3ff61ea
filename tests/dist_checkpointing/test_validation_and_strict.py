"""Pre-save validation (one clear error on every rank, nothing written) and every
StrictHandling value of load, on 2 gloo ranks."""

import logging
import os

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing import ShardedObject, ShardedTensor, StrictHandling
from nemo_ckpt.dist_checkpointing.validation import parse_strict_flag
from tests.helpers.distributed import run_distributed


def _bad_states(rank: int, ws: int) -> dict[str, dict]:
    x = torch.ones(4)
    return {
        # both ranks claim the main replica of the same shard
        "overlap": {"w": ShardedTensor.from_rank_offsets("w.overlap", x, (0, 0, ws))},
        # the grid has 4 shards but only 2 ranks hold them
        "missing": {"w": ShardedTensor.from_rank_offsets("w.missing", x, (0, rank, 2 * ws))},
        # ranks disagree on the global shape
        "shape": {"w": ShardedTensor.from_rank_offsets("w.shape", torch.ones(4 + rank), (0, rank, ws))},
        # ranks disagree on the dtype
        "dtype": {
            "w": ShardedTensor.from_rank_offsets(
                "w.dtype", x.to(torch.float64 if rank else torch.float32), (0, rank, ws)
            )
        },
        # two main replicas of one object
        "object": {"o": ShardedObject("obj", rank, (1,), (0,))},
        # a shard outside the global shape
        "bounds": {"w": ShardedTensor("w.bounds", x, torch.float32, (4,), (6,), (4 * rank,), None)},
    }


EXPECTED = {
    "overlap": ["w.overlap", "overlap", "rank 0", "rank 1"],
    "missing": ["w.missing", "cover 8 of 16", "ranks [0, 1]"],
    "shape": ["w.shape", "global_shape", "rank 1", "rank 0"],
    "dtype": ["w.dtype", "dtype", "rank 1"],
    "object": ["obj", "main replicas on several ranks [0, 1]"],
    "bounds": ["w.bounds", "outside global shape (6,)", "rank 1"],
}


def _save_invalid(rank: int, ws: int, root: str) -> dict:
    messages = {}
    for name, state in _bad_states(rank, ws).items():
        ckpt = os.path.join(root, name)
        os.makedirs(ckpt, exist_ok=True)
        with pytest.raises(dc.CheckpointingException) as exc:
            dc.save(state, ckpt)
        messages[name] = str(exc.value)
        torch.distributed.barrier()
        assert os.listdir(ckpt) == [], f"{name}: files written before validation failed"
    return messages


def test_invalid_sharding_raises_on_all_ranks_and_writes_nothing(tmp_path):
    results = run_distributed(_save_invalid, 2, str(tmp_path))
    for rank_messages in results:
        for name, fragments in EXPECTED.items():
            for fragment in fragments:
                assert fragment in rank_messages[name], (name, fragment, rank_messages[name])


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _strict_body(rank: int, ws: int, ckpt: str) -> dict:
    dc.save(
        {
            "a": ShardedTensor.from_rank_offsets("a", torch.full((2,), float(rank)), (0, rank, ws)),
            "b": ShardedTensor.from_rank_offsets("b", torch.ones(2), replica_id=rank),
        },
        ckpt,
    )

    def request():  # 'b' is missing from the request, 'c' (rank 0 only) is unexpected
        sd = {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2), (0, rank, ws))}
        if rank == 0:
            sd["c"] = ShardedTensor.from_rank_offsets("c", torch.zeros(2))
        return sd

    handler = _ListHandler()
    logging.getLogger("nemo_ckpt.dist_checkpointing").addHandler(handler)
    out = {}
    for strict in StrictHandling:
        handler.messages.clear()
        try:
            result = dc.load(request(), ckpt, strict=strict)
        except dc.CheckpointingException as e:
            out[strict.value] = ("raised", str(e))
            continue
        if isinstance(result, tuple):
            sd, missing, unexpected = result
            out[strict.value] = ("tuple", sorted(sd), sorted(missing), sorted(unexpected), sd["a"].tolist())
        else:
            out[strict.value] = ("dict", sorted(result), list(handler.messages), result["a"].tolist())
    return out


def test_every_strict_handling_value(tmp_path):
    results = run_distributed(_strict_body, 2, str(tmp_path))
    for rank, out in enumerate(results):
        a = [float(rank)] * 2
        if rank == 0:
            # no check: 'c' is really read and is not in the checkpoint
            assert out["assume_ok_unexpected"][0] == "raised" and "Key 'c' not found" in out["assume_ok_unexpected"][1]
            kind, keys, logs, val = out["log_unexpected"]
            assert keys == ["a"] and val == a and any("'c'" in m for m in logs) and not any("'b'" in m for m in logs)
            kind, keys, logs, val = out["log_all"]
            assert keys == ["a"] and any("'c'" in m and "'b'" in m for m in logs)
            assert out["raise_unexpected"][0] == "raised" and "'c'" in out["raise_unexpected"][1]
            assert out["raise_all"][0] == "raised" and "'b'" in out["raise_all"][1] and "'c'" in out["raise_all"][1]
            assert out["return_unexpected"] == ("tuple", ["a"], [], ["c"], a)
            assert out["return_all"] == ("tuple", ["a"], ["b"], ["c"], a)
        else:
            assert out["assume_ok_unexpected"] == ("dict", ["a"], [], a)
            assert out["log_unexpected"] == ("dict", ["a"], [], a)
            assert out["log_all"][:2] == ("dict", ["a"]) and any("'b'" in m for m in out["log_all"][2])
            assert out["raise_unexpected"] == ("dict", ["a"], [], a)
            assert out["raise_all"][0] == "raised" and "'b'" in out["raise_all"][1]  # missing keys are global
            assert out["return_unexpected"] == ("tuple", ["a"], [], [], a)
            assert out["return_all"] == ("tuple", ["a"], ["b"], [], a)
        assert out["ignore_all"] == ("dict", ["a"], [], a)


def test_parse_strict_flag():
    assert parse_strict_flag("raise_all") is StrictHandling.RAISE_ALL
    assert parse_strict_flag(StrictHandling.LOG_ALL) is StrictHandling.LOG_ALL
    with pytest.raises(ValueError, match="Invalid strict flag"):
        parse_strict_flag("nope")

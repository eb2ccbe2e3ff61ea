"""DistCheckpointIO's ckpt_* options: errors for bad values, async completion at finalize, the async writer process
started at set-up where it is used, and the tiny recipe trained with async (thread or writer process) / parallel
options on 2 ranks, killed and resumed bit-identically."""

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

from nemo_ckpt import dist_checkpointing as dc
from nemo_ckpt.dist_checkpointing.strategies import writer_process
from nemo_ckpt.dist_checkpointing.strategies.writer_process import shared_memory_available
from nemo_ckpt.strategy import MegatronStrategy
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions
from tests.helpers.tiny_run import checkpoints, losses, run_tiny, step_dir


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="save_ckpt_format='zarr'"):
        DistCheckpointIO(DistCheckpointOptions(save_ckpt_format="zarr"))
    with pytest.raises(ValueError, match="ckpt_torch_dist_multiproc=0"):
        DistCheckpointIO(DistCheckpointOptions(ckpt_torch_dist_multiproc=0))
    with pytest.raises(ValueError, match="strict"):
        DistCheckpointIO(DistCheckpointOptions(ckpt_load_strictness="sometimes"))


def test_async_checkpoint_io_finalizes_at_maybe_finalize_and_teardown(tmp_path):
    io = DistCheckpointIO(
        DistCheckpointOptions(
            ckpt_async_save=True,
            ckpt_parallel_save=True,
            ckpt_parallel_load=True,
            ckpt_torch_dist_multiproc=2,
            ckpt_assume_constant_structure=True,
        )
    )
    committed = []
    for step in range(3):
        weights = torch.full((4, 4), float(step))
        io.save_checkpoint(
            {"w": dc.ShardedTensor.from_rank_offsets("w", weights), "step": step},
            tmp_path / f"s{step}",
            storage_options={"finalize_fn": lambda step=step: committed.append(step)},
        )
        weights.add_(100)
    assert committed == [0, 1], "a new save first completes the one in flight"
    io.teardown()
    assert committed == [0, 1, 2]
    loaded = io.load_checkpoint(
        tmp_path / "s2", sharded_state_dict={"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}
    )
    assert torch.equal(loaded["w"], torch.full((4, 4), 2.0)) and loaded["step"] == 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("reference")
    assert run_tiny(directory, max_steps=10) == 0
    return directory


@pytest.mark.parametrize(
    "options",
    [
        {"ckpt_async_save": True},
        {"ckpt_async_save": True, "ckpt_assume_constant_structure": True, "ckpt_async_writer_process": True},
        {
            "ckpt_parallel_save": True,
            "ckpt_parallel_load": True,
            "ckpt_parallel_save_optim": True,
            "ckpt_torch_dist_multiproc": 3,
            "ckpt_assume_constant_structure": True,
        },
    ],
    ids=["async", "async-writer-process", "parallel"],
)
def test_killed_run_with_options_resumes_like_the_reference(reference, tmp_path, options):
    assert run_tiny(tmp_path, 10, options, kill_at_step=7) != 0
    manifest = json.loads((checkpoints(tmp_path) / "checkpoints.json").read_text())
    committed = [(record["step"], record["state"]) for record in manifest["checkpoints"]]
    assert committed == [(5, "complete")], "step 5 was committed during training"
    assert run_tiny(tmp_path, 10, options) == 0
    assert min(losses(tmp_path)) == 5
    assert losses(tmp_path) == {step: loss for step, loss in losses(reference).items() if step >= 5}
    files_per_rank = options.get("ckpt_torch_dist_multiproc", 2)
    weights = step_dir(tmp_path, 10) / "weights"
    assert (weights / "metadata.json").is_file()
    files = {p.name for p in weights.glob("*.distcp")}
    assert {f"__0_{i}.distcp" for i in range(files_per_rank)} <= files  # rank 0 has data for every writer
    assert files <= {f"__{rank}_{i}.distcp" for rank in range(2) for i in range(files_per_rank)}
    expected = dc.load_plain_tensors(step_dir(reference, 10) / "weights")
    resumed = dc.load_plain_tensors(weights)
    assert expected.keys() == resumed.keys()
    assert all(torch.equal(expected[key], resumed[key]) for key in expected)
    assert not list(checkpoints(tmp_path).glob(".tmp-*"))


@pytest.mark.skipif(not shared_memory_available(), reason="the writer process needs Linux (memfd)")
def test_the_writer_process_starts_at_set_up_only_where_async_saves_use_it(monkeypatch):
    monkeypatch.setattr(writer_process, "_shared", None)
    uses = {"ckpt_async_save": True, "ckpt_assume_constant_structure": True, "ckpt_async_writer_process": True}
    for options, device in [
        ({"ckpt_async_save": True, "ckpt_async_writer_process": True}, "cpu"),
        ({**uses, "ckpt_async_writer_process": False}, "cpu"),
        (uses, "meta"),  # stands for a GPU: its shards are staged into pinned memory, written by a thread
    ]:
        DistCheckpointIO(DistCheckpointOptions(**options)).start_writer_process(torch.device(device))
        assert writer_process._shared is None, options
    DistCheckpointIO(DistCheckpointOptions(**uses)).start_writer_process(torch.device("cpu"))
    assert writer_process._shared is not None and writer_process._shared.alive
    writer_process._shared.close()


def test_strategy_takes_every_checkpoint_option_with_its_default():
    parameters = inspect.signature(MegatronStrategy).parameters
    for field in dataclasses.fields(DistCheckpointOptions):
        assert parameters[field.name].default == field.default, field.name
    strategy = MegatronStrategy(ckpt_async_save=True, ckpt_torch_dist_multiproc=3)
    assert strategy.checkpoint_io.options == DistCheckpointOptions(ckpt_async_save=True, ckpt_torch_dist_multiproc=3)


def test_misspelt_options_and_megatron_checkpoint_io_arguments_are_named():
    from nemo_ckpt.checkpoint import ModelCheckpoint

    with pytest.raises(TypeError, match=r"unknown option `ckpt_async_sav`; did you mean `ckpt_async_save`\?"):
        DistCheckpointOptions(ckpt_async_sav=True)
    with pytest.raises(ValueError, match=r"not supported: async_save .*DistCheckpointOptions\(ckpt_async_save=...\)"):
        DistCheckpointIO(async_save=True)
    with pytest.raises(TypeError, match=r"did you mean `every_n_train_steps`\?"):
        ModelCheckpoint(every_n_train_step=5)
    with pytest.raises(ValueError, match="ckpt_async_save_failure='ignore'"):
        DistCheckpointOptions(ckpt_async_save_failure="ignore")
    with pytest.raises(ValueError, match="ckpt_async_save_timeout=0"):
        DistCheckpointOptions(ckpt_async_save_timeout=0)

"""Canaries for `nemo_ckpt._compat`, the one home of private torch, Lightning and NeMo-Run APIs: each entry still
exists and does what nemo_ckpt relies on. Run these first after upgrading a dependency."""

import io
import pickle
import re
import struct
import zipfile
from importlib.metadata import version

import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from nemo_ckpt import _compat
from tests.helpers.distributed import run_distributed


def _write_item(tensor: torch.Tensor) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size([0] * tensor.dim()), tensor.shape)
    data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=tensor.dtype), size=tensor.shape)
    return WriteItem(index=MetadataIndex("w", chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)


def test_versions_are_the_tested_ones(monkeypatch):
    monkeypatch.delenv(_compat.ALLOW_UNTESTED, raising=False)
    _compat._check_versions()


def test_an_untested_version_raises_unless_allowed_and_a_missing_library_is_not_checked(monkeypatch):
    monkeypatch.setitem(_compat.TESTED, "torch", ("1.0.",))
    monkeypatch.delenv(_compat.ALLOW_UNTESTED, raising=False)
    found = re.escape(f"found {{'torch': '{version('torch')}'}}; run `NEMO_CKPT_ALLOW_UNTESTED_VERSIONS=1 pytest")
    with pytest.raises(ImportError, match=found):
        _compat._check_versions()
    monkeypatch.setenv(_compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match="checked against"):
        _compat._check_versions()
    monkeypatch.delenv(_compat.ALLOW_UNTESTED)
    monkeypatch.setitem(_compat.TESTED, "torch", (version("torch"),))
    monkeypatch.setitem(_compat.TESTED, "a-library-not-installed", ("1.",))
    _compat._check_versions()


def test_dcp_write_item_and_our_tensor_write_give_loadable_torch_saves():
    tensor = torch.arange(12.0).view(3, 4)
    stream = io.BytesIO()
    result = _compat.dcp_write_item(stream, tensor, _write_item(tensor), "__0_0.distcp")
    assert isinstance(result.storage_data, _compat.StorageInfo)
    assert (result.storage_data.offset, result.storage_data.length) == (0, len(stream.getvalue()))
    assert torch.equal(torch.load(io.BytesIO(stream.getvalue())), tensor)

    for crc32, alignment in ((False, None), (True, 4096)):
        raw = io.BytesIO()
        _compat.write_tensor(raw, tensor, crc32, alignment)
        assert torch.equal(torch.load(io.BytesIO(raw.getvalue())), tensor)
        with zipfile.ZipFile(io.BytesIO(raw.getvalue())) as archive:
            (data,) = [info for info in archive.infolist() if info.filename.endswith("/data/0")]
            assert data.CRC == (zipfile.crc32(tensor.numpy().tobytes()) if crc32 else 0)
            name_length, extra_length = struct.unpack_from("<HH", raw.getvalue(), data.header_offset + 26)
            start = data.header_offset + 30 + name_length + extra_length  # after the local header
        if alignment:  # the storage's bytes start at a multiple of the alignment
            assert start % alignment == 0 and raw.getvalue()[start : start + 48] == tensor.numpy().tobytes()


def test_storage_type_dtypes_name_the_legacy_storages():
    dtypes = _compat.storage_type_dtypes()
    assert dtypes["FloatStorage"] == torch.float32 and dtypes["BFloat16Storage"] == torch.bfloat16


def test_numpy_array_reconstructor_is_what_array_pickles_name():
    name = pickle.dumps(np.arange(3)).decode("latin-1")
    reconstructor = _compat.numpy_array_reconstructor()
    assert reconstructor.__name__ in name and reconstructor.__module__.split(".")[-1] in name


def _dtensor_shapes(rank: int, world_size: int) -> list:
    mesh = init_device_mesh("cpu", (world_size,))
    tensor = torch.arange(20.0).view(5, 4)
    sharded = distribute_tensor(tensor, mesh, [Shard(0)])
    replicated = distribute_tensor(tensor, mesh, [Replicate()])
    return [_compat.dtensor_local_shape_and_offset(sharded), _compat.dtensor_local_shape_and_offset(replicated)]


def test_dtensor_local_shape_and_offset_on_two_ranks():
    shard, replicated = zip(*run_distributed(_dtensor_shapes, 2))
    assert shard == (((3, 4), (0, 0)), ((2, 4), (3, 0)))
    assert replicated == (((5, 4), (0, 0)), ((5, 4), (0, 0)))


def _flattened_group_ranks(rank: int, world_size: int) -> list[int]:
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "b"))
    _compat.flatten_mesh_dims(mesh, ("a", "b"), "ab")
    return dist.get_process_group_ranks(mesh["ab"].get_group())


def test_flatten_mesh_dims_makes_a_named_dimension_over_both():
    assert run_distributed(_flattened_group_ranks, 2) == [[0, 1], [0, 1]]


def test_strided_shard_is_recognized():
    assert _compat.is_strided_shard(_StridedShard(0, split_factor=2))
    assert not _compat.is_strided_shard(Shard(0)) and not _compat.is_strided_shard(Replicate())


def test_optimizers_to_device_moves_lightning_optimizer_state():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(2)
    optimizer.step()
    _compat.optimizers_to_device([LightningOptimizer(optimizer)], torch.device("meta"))
    assert optimizer.state[param]["exp_avg"].is_meta


def test_lightning_ddp_kwargs_are_the_strategy_s_extra_arguments():
    assert _compat.lightning_ddp_kwargs(DDPStrategy(find_unused_parameters=True)) == {"find_unused_parameters": True}


def test_nemo_run_experiment_dir(tmp_path):
    run = pytest.importorskip("nemo_run")
    with run.Experiment("canary", base_dir=str(tmp_path), log_level="WARN") as experiment:
        directory = _compat.nemo_run_experiment_dir(experiment)
    assert directory.parent.name == "canary" and tmp_path in directory.parents


def test_nemo_run_cli_parses_union_types_with_our_parser_falling_back_on_nemo_run_s():
    pytest.importorskip("nemo_run")
    from nemo_run.cli.cli_parser import parse_cli_args

    def entry(paths: str | list | None = None, steps: int | None = None) -> None: ...

    def parse(value, annotation, parse_union):
        return value.split("+") if "+" in value else parse_union(value, annotation)

    _compat.nemo_run_cli_parse_union_types_with(parse)
    try:
        parsed = parse_cli_args(entry, ["paths=a+b", "steps=5"])
        assert (parsed.paths, parsed.steps) == (["a", "b"], 5)
    finally:
        from launch import overrides

        overrides.register()  # the command line's parser again, for later tests in this process


def test_register_fiddle_cast_silences_fiddle_s_warning(caplog):
    import fiddle as fdl

    class Source(fdl.Config): ...

    class Target(fdl.Config): ...

    fdl.cast(Target, Source(dict))
    assert "has not been marked as officially supported" in caplog.text
    caplog.clear()
    _compat.register_fiddle_cast(Source, Target)
    assert isinstance(fdl.cast(Target, Source(dict)), Target) and not caplog.text


def test_nemo_run_cli_splits_run_args_as_cli_execute_does():
    pytest.importorskip("nemo_run")
    args = ["run.executor=local", "run.executor.ntasks_per_node=2", "trainer.max_steps=5", "run.detach=True"]
    run_args, task_args = _compat.nemo_run_cli_split_run_args(args)
    assert run_args == ["executor=local", "executor.ntasks_per_node=2", "detach=True"]
    assert task_args == ["trainer.max_steps=5"]


def test_redirect_logger_moves_lightning_loggers_keeping_name_and_version(tmp_path):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    elsewhere, run_dir = tmp_path / "elsewhere", tmp_path / "run"
    for logger in (TensorBoardLogger(elsewhere, name="tb", version="v"), CSVLogger(elsewhere, "csv", "v")):
        _compat.redirect_logger(logger, run_dir)
        assert logger.save_dir == str(run_dir)
        assert logger.log_dir == str(run_dir / logger.name / "v")
        logger.log_metrics({"x": 1.0}, step=0)
        logger.finalize("success")
        assert any((run_dir / logger.name / "v").iterdir())
    assert not elsewhere.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="async TP needs CUDA")
def test_async_tensor_parallel_switches_inductor_on():  # pragma: no cover - GPU only
    from torch._inductor import config as inductor_config

    torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29512", rank=0, world_size=1)
    try:
        _compat.enable_async_tensor_parallel(torch.distributed.group.WORLD.group_name)
        assert inductor_config._micro_pipeline_tp
    finally:
        torch.distributed.destroy_process_group()


def test_one_f_one_b_order_is_megatron_s_non_interleaved_schedule():
    def order(rank: int) -> list[str]:
        actions = _compat.one_f_one_b_order(2, rank, 4)
        return [f"{action.computation_type.value}{action.microbatch_index}" for action in actions if action]

    assert order(0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]  # one warm-up forward
    assert order(1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]  # the last stage: none
    assert all(action.stage_index == 1 for action in _compat.one_f_one_b_order(2, 1, 4) if action)

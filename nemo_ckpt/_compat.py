"""Every private API of torch, Lightning and NeMo-Run that nemo_ckpt uses, behind one version guard.

Nothing else in the package imports a private name of another library. Each entry has a canary test in
`tests/test_compat.py`; after upgrading torch, Lightning or NeMo-Run, run it first: a failing canary names the
entry to port. Versions outside the tested range raise at import with that instruction, unless
`NEMO_CKPT_ALLOW_UNTESTED_VERSIONS=1` makes that a warning (to run the canaries on a new version, or on a machine
whose torch cannot be changed). A library that is not installed is not checked: the entries that use it fail when
called.
"""

import io
import os
import pickle
import warnings
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    SerializationFormat,
    _StorageInfo,
    _StorageWriterTransforms,
    _write_item,
)
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

TESTED = {"torch": ("2.13.",), "lightning": ("2.6.",), "nemo_run": ("0.11.",), "numpy": ("1.", "2.")}
ALLOW_UNTESTED = "NEMO_CKPT_ALLOW_UNTESTED_VERSIONS"


def _installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _check_versions() -> None:
    found = {name: _installed_version(name) for name in TESTED}
    untested = {name: v for name, v in found.items() if v is not None and not v.startswith(TESTED[name])}
    if not untested:
        return
    message = (
        f"nemo_ckpt uses private APIs checked against {TESTED} only, found {untested}; run "
        f"`{ALLOW_UNTESTED}=1 pytest tests/test_compat.py` and port the failing entries of nemo_ckpt/_compat.py"
    )
    if os.environ.get(ALLOW_UNTESTED) == "1":
        warnings.warn(message, stacklevel=2)
    else:
        raise ImportError(message + f" (or set {ALLOW_UNTESTED}=1 to go on at your own risk)")


_check_versions()

__all__ = [
    "StorageInfo",
    "dcp_write_item",
    "dtensor_local_shape_and_offset",
    "enable_async_tensor_parallel",
    "flatten_mesh_dims",
    "is_strided_shard",
    "lightning_ddp_kwargs",
    "nemo_run_cli_parse_union_types_with",
    "nemo_run_cli_split_run_args",
    "nemo_run_experiment_dir",
    "numpy_array_reconstructor",
    "one_f_one_b_order",
    "optimizers_to_device",
    "redirect_logger",
    "storage_type_dtypes",
    "unbatched_1f1b_schedule",
    "write_tensor",
]

StorageInfo = _StorageInfo
"""DCP's record of where an item lies in a `.distcp` file (relative path, offset, length)."""


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the state of Lightning's optimizers to a device (what `DDPStrategy.setup` does)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def dcp_write_item(stream: io.IOBase, data: torch.Tensor | io.BytesIO, item: WriteItem, name: str) -> WriteResult:
    """Append one DCP item to `stream` exactly as `FileSystemWriter` does (a `torch.save` zip, with CRC-32s)."""
    return _write_item(_StorageWriterTransforms(), stream, data, item, name, SerializationFormat.TORCH_SAVE)


def write_tensor(stream: io.IOBase, tensor: torch.Tensor, crc32: bool, storage_alignment: int | None = None) -> None:
    """`torch.save(tensor, stream)` with or without the zip's CRC-32s and with the storage's bytes at a multiple of
    `storage_alignment` from the save's start (default: torch's setting), for this call only (torch's
    `compute_crc32` and `storage_alignment` are process-wide settings)."""
    alignment = storage_alignment or torch.serialization._get_storage_alignment()
    writer = torch._C.PyTorchFileWriter(stream, crc32, alignment)
    torch.serialization._save(tensor, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def storage_type_dtypes() -> dict[str, torch.dtype]:
    """The dtype of each legacy storage class name a `torch.save` pickle may name (`FloatStorage`, ...)."""
    return torch.storage._storage_type_to_dtype_map()


def dtensor_local_shape_and_offset(tensor: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shard shape and its offset in the global tensor, for any placements."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def is_strided_shard(placement: Placement) -> bool:
    """Whether `placement` is the strided `Shard` torch records for FSDP over a TP-sharded dim."""
    return isinstance(placement, _StridedShard)


def flatten_mesh_dims(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Register `dims` of `mesh` flattened into one dimension `name` (then `mesh[name]`), as torchtitan does."""
    return mesh[dims]._flatten(name)


def enable_async_tensor_parallel(group_name: str) -> None:
    """Torch async TP (CUDA): Inductor fuses TP collectives with matmuls, on symmetric memory of the group."""
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(group_name)


def one_f_one_b_order(pp_size: int, rank: int, n_microbatches: int) -> list[Any]:
    """Megatron's non-interleaved 1F1B order of `rank`'s stage (stage index = rank) as torch's schedule actions
    (None: an idle slot): `pp_size - 1 - rank` warm-up forwards, then one forward and one backward, then the
    remaining backwards. Built by torch's private `_get_1f1b_rank_ops` for one local stage."""
    from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops

    warmup = min(pp_size - 1 - rank, n_microbatches)
    steady = n_microbatches - warmup
    return _get_1f1b_rank_ops(1, pp_size, warmup, steady, warmup, rank, lambda _: rank, lambda _: rank)


def unbatched_1f1b_schedule(
    stage: Any, n_microbatches: int, loss_fn: Callable[..., torch.Tensor]
) -> "torch.distributed.pipelining.ScheduleInterleaved1F1B":
    """The 1F1B order (`one_f_one_b_order`) run by torch's action runtime, which posts every send and receive as
    its own operation, each receive just before its use (`defer_pp_recv`). `Schedule1F1B` runs the same order
    but batches a step's send and receive into one `batch_isend_irecv`. Overrides the interleaved schedule's
    private per-rank order."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    class Unbatched1F1B(ScheduleInterleaved1F1B):
        def _calculate_single_rank_operations(self, rank: int) -> list[Any]:
            return one_f_one_b_order(self.pp_group_size, rank, self._n_microbatches)

    return Unbatched1F1B([stage], n_microbatches, loss_fn=loss_fn, scale_grads=True, defer_pp_recv=True)


def numpy_array_reconstructor() -> Callable[..., Any]:
    """The function numpy's pickles of arrays name (`numpy._core.multiarray._reconstruct`)."""
    from numpy._core.multiarray import _reconstruct

    return _reconstruct


def nemo_run_experiment_dir(experiment: Any) -> Path:
    """The directory a NeMo-Run experiment writes its scripts to."""
    return Path(experiment._exp_dir)


def lightning_ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments Lightning's `DDPStrategy` keeps for `DistributedDataParallel`."""
    return strategy._ddp_kwargs


def redirect_logger(logger: Any, save_dir: str | Path) -> None:
    """Make a Lightning `TensorBoardLogger` or `CSVLogger` that has not written yet write under `save_dir` (as if
    built with it), keeping its name and version (what NeMo's `update_logger_directory` does)."""
    from lightning.pytorch.loggers import CSVLogger

    logger._root_dir = str(save_dir)
    if isinstance(logger, CSVLogger):
        logger._save_dir = str(save_dir)


def nemo_run_cli_parse_union_types_with(parse: Callable[[str, Any, Callable[[str, Any], Any]], Any]) -> None:
    """Make NeMo-Run's command line parse PEP 604 unions (`str | list`) with `parse(value, annotation, parse_union)`,
    where `parse_union` is NeMo-Run's own union parser (the first member that accepts the value wins)."""
    import types

    from nemo_run.cli.cli_parser import parse_value, type_parser

    def parse_union_type(value: str, annotation: Any) -> Any:
        return parse(value, annotation, type_parser.parse_union)

    type_parser.register_parser(types.UnionType)(parse_union_type)
    type_parser.get_parser.cache_clear()
    parse_value.cache_clear()


def register_fiddle_cast(source: type, target: type) -> None:
    """Mark `fdl.cast(target, <a source config>)` as supported: Fiddle logs a warning for each other cast, and
    NeMo-Run casts every config of a task it launches to its own classes."""
    from fiddle._src.casting import register_supported_cast

    register_supported_cast(source, target)


def nemo_run_cli_split_run_args(args: list[str]) -> tuple[list[str], list[str]]:
    """A command line's overrides split as NeMo-Run's `RunContext.cli_execute` splits them: those of the run context
    (`run.executor=local` -> `executor=local`) and those of the task (`trainer.max_steps=5`)."""
    from nemo_run.cli.api import _parse_prefixed_args

    _, run_args, task_args = _parse_prefixed_args(args, "run")
    return run_args, task_args

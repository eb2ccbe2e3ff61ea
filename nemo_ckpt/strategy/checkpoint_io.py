"""`DistCheckpointIO`: Lightning's CheckpointIO on `nemo_ckpt.dist_checkpointing`, with NeMo's speed options."""

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch.distributed import ProcessGroup

from nemo_ckpt import dist_checkpointing
from nemo_ckpt.checkpoint.layout import context_dir, weights_dir
from nemo_ckpt.dist_checkpointing.integrity import MissingChecksumsError, raise_if_corrupt, written_with_checksums
from nemo_ckpt.dist_checkpointing.mapping import ShardedBase
from nemo_ckpt.dist_checkpointing.serialization import get_default_load_sharded_strategy
from nemo_ckpt.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncSaveFailure
from nemo_ckpt.dist_checkpointing.strategies.filesystem_async import order_after_deferred_copies
from nemo_ckpt.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from nemo_ckpt.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from nemo_ckpt.dist_checkpointing.strategies.writer_process import shared_memory_available, shared_writer_process
from nemo_ckpt.dist_checkpointing.utils import raise_on_every_rank
from nemo_ckpt.dist_checkpointing.validation import parse_strict_flag
from nemo_ckpt.options import strict_options

log = logging.getLogger(__name__)

OPTIMIZER_KEY_PREFIX = "optimizer."
ASYNC_SAVE_FAILURE_POLICIES = ("raise", "warn")


def _is_model_shard(sh: ShardedBase) -> bool:
    return not sh.key.startswith(OPTIMIZER_KEY_PREFIX)


def _is_optimizer_shard(sh: ShardedBase) -> bool:
    return sh.key.startswith(OPTIMIZER_KEY_PREFIX)


class MissingOptimizerStateError(KeyError):
    """Resuming a checkpoint's optimizer state from a checkpoint saved without it."""

    def __str__(self) -> str:
        return str(self.args[0])


def require_optimizer_state(path: str | Path, verify: bool = True) -> None:
    """Raise `MissingOptimizerStateError` if checkpoint `path` holds no optimizer state (weights only). Its common
    state is checked against its checksum with `verify`; a checkpoint that lost its checksums is read unverified
    here, the load that follows refuses it unless verification is off."""
    try:
        common = dist_checkpointing.load_common_state_dict(weights_dir(path), verify=verify)
    except MissingChecksumsError:
        common = dist_checkpointing.load_common_state_dict(weights_dir(path), verify=False)
    if "optimizer_states" not in common:
        raise MissingOptimizerStateError(
            f"{path} holds no optimizer state (a weights-only checkpoint, e.g. saved at the end of training with "
            "ModelCheckpoint(save_optim_on_train_end=False)): set trainer.strategy.ckpt_load_optimizer=False to resume "
            "its weights with a fresh optimizer, or resume another checkpoint"
        )


@strict_options()
@dataclass(frozen=True)
class DistCheckpointOptions:
    """How checkpoints are written and read: NeMo's `MegatronStrategy` options, under the same names and
    defaults (replicated shards are written once, spread over the ranks, as in NeMo).

    save_ckpt_format: 'torch_dist' (saving 'zarr' is not supported; zarr checkpoints still load).
    ckpt_async_save: stage to CPU and write in the background; the checkpoint is completed (metadata.json,
        then `finalize_fn`) by `DistCheckpointIO.maybe_finalize`, which the strategy calls every step and at
        teardown. GPU shards are staged into pinned memory on a side stream.
    ckpt_parallel_save: spread the writing of replicated model shards evenly over the ranks.
    ckpt_parallel_save_within_dp: spread it within the data-parallel group only (set by the strategy with
        `set_data_parallel_group`; the world until then).
    ckpt_parallel_load: read each replicated shard once and broadcast it within the data-parallel group.
    ckpt_torch_dist_multiproc: writer threads (files) per rank; None: 2, as in NeMo and Megatron-Core.
    ckpt_assume_constant_structure: validate the sharding and compute the save distribution once, cache the
        checkpoint metadata between saves, and keep the CPU copies of async saves for the next save (one copy
        of the rank's state stays in host memory; copying into it is several times faster than into new
        memory).
    ckpt_parallel_save_optim: spread the writing of the replicated optimizer state too.
    ckpt_load_directly_on_device: loaded tensors without a destination go to the current accelerator (loads
        into the template's tensors go there wherever they are).
    ckpt_load_strictness: a `StrictHandling` value for key mismatches.
    ckpt_async_save_timeout: seconds an async save may take to write (from its start) before it fails on every
        rank (None: no limit), so a stuck file system cannot block training forever.
    ckpt_async_save_failure: what a failed async save does at its finalize: 'raise' (stop the run) or 'warn'
        (log it, discard that checkpoint, keep training; the next interval saves again).
    ckpt_verify_on_load: check every byte a load reads against the CRC32C checksums stored at save, as it is read
        (and the checkpoint's `context/` files), raising `CorruptCheckpointError` (file, byte range) before any
        loaded value is used; `python -m nemo_ckpt verify` checks every file offline. A checkpoint we saved whose
        `checksums.json` is missing is refused (`MissingChecksumsError`); those of Megatron-Core or NeMo (no
        checksums) load unverified. False: nothing is checked, a checkpoint that lost its checksums loads.
    ckpt_async_writer_process: with `ckpt_async_save` and `ckpt_assume_constant_structure`, a persistent process
        per rank (as Megatron-LM's `--use-persistent-ckpt-worker`) writes the saves from the kept CPU copies, which
        then live in shared memory, instead of a thread of the training process: the writer no longer shares the
        training process's GIL (Linux; GPU shards, staged into pinned memory, and other systems use the thread).
    ckpt_async_overlap_staging: with `ckpt_async_save`, a save of GPU shards returns before training's CUDA stream
        waits for their copies into host memory, so the copies overlap the next forward and backward; the owner
        calls `DistCheckpointIO.order_after_staging()` before anything changes a saved tensor (`MegatronStrategy`
        does before the optimizer's update, and at the save where the model has GPU buffers, which forward may
        change). Code that changes weights in place outside the optimizer between a save and the next update (an
        EMA swap for validation) must call it first, or the checkpoint may hold changed values. False (default):
        the stream waits for the copies at the save, and nothing else is needed.
    """

    save_ckpt_format: str = "torch_dist"
    ckpt_async_save: bool = False
    ckpt_parallel_save: bool = True
    ckpt_parallel_save_within_dp: bool = False
    ckpt_parallel_load: bool = False
    ckpt_torch_dist_multiproc: int | None = None
    ckpt_assume_constant_structure: bool = False
    ckpt_parallel_save_optim: bool = True
    ckpt_load_directly_on_device: bool = False
    ckpt_load_strictness: str | None = None
    ckpt_async_save_timeout: float | None = None
    ckpt_async_save_failure: str = "raise"
    ckpt_verify_on_load: bool = True
    ckpt_async_writer_process: bool = False
    ckpt_async_overlap_staging: bool = False

    def __post_init__(self) -> None:
        if self.save_ckpt_format != "torch_dist":
            raise ValueError(
                f"MegatronStrategy(save_ckpt_format={self.save_ckpt_format!r}): only 'torch_dist' can "
                "be saved ('zarr' is deprecated; zarr checkpoints still load, convert them with "
                "`python -m nemo_ckpt.dist_checkpointing.converter`)"
            )
        if self.ckpt_torch_dist_multiproc is not None and self.ckpt_torch_dist_multiproc < 1:
            raise ValueError(
                f"MegatronStrategy(ckpt_torch_dist_multiproc={self.ckpt_torch_dist_multiproc}): use 1 "
                "or more writers per rank, or None for the default (2)"
            )
        if self.ckpt_load_strictness is not None:
            parse_strict_flag(self.ckpt_load_strictness)
        if self.ckpt_async_save_timeout is not None and self.ckpt_async_save_timeout <= 0:
            raise ValueError(
                f"MegatronStrategy(ckpt_async_save_timeout={self.ckpt_async_save_timeout}): use a positive number of "
                "seconds, or None for no limit"
            )
        if self.ckpt_async_save_failure not in ASYNC_SAVE_FAILURE_POLICIES:
            raise ValueError(
                f"MegatronStrategy(ckpt_async_save_failure={self.ckpt_async_save_failure!r}): use one of "
                f"{ASYNC_SAVE_FAILURE_POLICIES}"
            )


# NeMo's MegatronCheckpointIO arguments: here they are DistCheckpointOptions fields.
MEGATRON_CHECKPOINT_IO_ARGUMENTS = {
    name: f"MegatronCheckpointIO's `{name}`; pass DistCheckpointIO(DistCheckpointOptions(ckpt_{name}=...))"
    for name in (
        "async_save",
        "torch_dist_multiproc",
        "assume_constant_structure",
        "parallel_save",
        "parallel_save_within_dp",
        "parallel_load",
        "load_directly_on_device",
    )
} | {"save_ckpt_format": "MegatronCheckpointIO's `save_ckpt_format`; pass DistCheckpointOptions(save_ckpt_format=...)"}


@strict_options(MEGATRON_CHECKPOINT_IO_ARGUMENTS)
class DistCheckpointIO(CheckpointIO):
    """Saves a sharded checkpoint dict on every rank into `<path>/weights`, loads it back into a template,
    as `options` (a `DistCheckpointOptions`) say."""

    def __init__(self, options: DistCheckpointOptions | None = None) -> None:
        self.options = options or DistCheckpointOptions()
        self.async_calls = self._new_async_queue() if self.options.ckpt_async_save else None
        self._failure_fns: dict[int, Callable[[], None]] = {}
        self.data_parallel_group: ProcessGroup | None = None
        self._save_strategy = self._build_save_strategy()
        self._validated_sharding = False

    def _new_async_queue(self) -> AsyncCallsQueue:
        return AsyncCallsQueue(timeout=self.options.ckpt_async_save_timeout)

    def set_data_parallel_group(self, group: ProcessGroup | None) -> None:
        """The ranks that hold replicas of the same shards (None: the world); call before the first save."""
        self.data_parallel_group = group
        self._save_strategy = self._build_save_strategy()

    def start_writer_process(self, device: torch.device) -> None:
        """Start this process's async writer process now, if the options use one for training state on `device`
        (CPU: GPU shards are staged into pinned memory and written by a thread), so that its start overlaps the
        set-up instead of delaying the first checkpoint."""
        options = self.options
        uses_process = options.ckpt_async_save and options.ckpt_assume_constant_structure
        if uses_process and options.ckpt_async_writer_process and device.type == "cpu" and shared_memory_available():
            shared_writer_process()

    def _build_save_strategy(self) -> Any:
        options = self.options
        # crc32=False: torch.load (so DCP, Megatron-Core and our reader) never checks these CRCs, and computing
        # them is most of a save's CPU time; the files stay readable by all three.
        strategy = TorchDistSaveShardedStrategy(
            "torch_dist",
            1,
            thread_count=options.ckpt_torch_dist_multiproc or 2,
            cached_metadata=options.ckpt_assume_constant_structure,
            crc32=False,
            reuse_staging_buffers=options.ckpt_assume_constant_structure,
            writer_process=options.ckpt_async_writer_process,
            defer_device_copies=options.ckpt_async_overlap_staging,
        )
        if options.ckpt_parallel_save and options.ckpt_parallel_save_optim:
            include = None
        elif options.ckpt_parallel_save:
            include = _is_model_shard
        elif options.ckpt_parallel_save_optim:
            include = _is_optimizer_shard
        else:
            return strategy
        group = self.data_parallel_group if options.ckpt_parallel_save_within_dp else None
        return FullyParallelSaveStrategyWrapper(
            strategy,
            parallelization_group=group,
            do_cache_distribution=options.ckpt_assume_constant_structure,
            include=include,
        )

    def _load_strategy(self, source: Path) -> Any:
        strategy = get_default_load_sharded_strategy(source, verify=self.options.ckpt_verify_on_load)
        strategy.load_directly_on_device = self.options.ckpt_load_directly_on_device
        if self.options.ckpt_parallel_load:
            strategy = FullyParallelLoadStrategyWrapper(strategy, parallelization_group=self.data_parallel_group)
        return strategy

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Collective save. `storage_options={"finalize_fn": fn}`: `fn()` runs on every rank, in save order,
        once the checkpoint is complete on all ranks (for async saves: in a later `maybe_finalize`).
        `"failure_fn": fn`: with `ckpt_async_save_failure='warn'`, `fn()` runs on every rank when this async save
        failed, to discard it."""
        target = weights_dir(path)
        target.mkdir(parents=True, exist_ok=True)
        finalize_fn = (storage_options or {}).get("finalize_fn")
        failure_fn = (storage_options or {}).get("failure_fn")
        validate = not (self.options.ckpt_assume_constant_structure and self._validated_sharding)
        self._validated_sharding = True
        if self.async_calls is None:
            dist_checkpointing.save(checkpoint, target, self._save_strategy, validate_access_integrity=validate)
            if finalize_fn is not None:
                finalize_fn()
            return
        self.maybe_finalize(blocking=True)  # one save in flight at a time: each holds a CPU copy of the state
        request = dist_checkpointing.save(
            checkpoint, target, self._save_strategy, validate_access_integrity=validate, async_sharded_save=True
        )
        if finalize_fn is not None:
            request.add_finalize_fn(finalize_fn)
        index = self.async_calls.schedule_async_request(request)
        if failure_fn is not None:
            self._failure_fns[index] = failure_fn

    def order_after_staging(self) -> None:
        """Order the current CUDA stream after the device-to-host copies of earlier saves that it does not wait for
        yet (`ckpt_async_overlap_staging`): kernels queued from now on may change the saved tensors. The host does
        not block."""
        order_after_deferred_copies()

    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Complete the async saves that every rank has finished writing (all of them if `blocking`).

        Collective when saves are in flight; returns the finalized call indices. A failed save raises
        `AsyncSaveFailure` on every rank, or with `ckpt_async_save_failure='warn'` is logged and discarded.
        """
        finalized: list[int] = []
        while self.async_calls is not None and self.async_calls.get_num_unfinalized_calls():
            try:
                finalized += self.async_calls.maybe_finalize_async_calls(blocking=blocking)
                break
            except AsyncSaveFailure as failure:
                failure_fn = self._failure_fns.pop(failure.call_idx, None)
                if self.options.ckpt_async_save_failure == "raise":
                    raise
                log.warning("%s; that checkpoint is discarded and training goes on", failure)
                if failure_fn is not None:
                    failure_fn()
        for index in finalized:
            self._failure_fns.pop(index, None)
        return finalized

    def load_checkpoint(
        self,
        path: str | Path,
        map_location: Any = None,
        sharded_state_dict: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        if sharded_state_dict is None:
            raise ValueError("DistCheckpointIO.load_checkpoint needs `sharded_state_dict`, the template to load into")
        self.order_after_staging()  # the load writes into the template's tensors
        source = weights_dir(path)
        strictness = self.options.ckpt_load_strictness
        strict = {} if strictness is None else {"strict": strictness}
        verify = self.options.ckpt_verify_on_load
        error, loaded = None, {}
        try:
            if verify and context_dir(path).is_dir():  # saved with the weights' marker: it has checksums too
                raise_if_corrupt(context_dir(path), required=written_with_checksums(source))
            loaded = dist_checkpointing.load(
                sharded_state_dict, source, sharded_strategy=self._load_strategy(source), verify=verify, **strict
            )
        except Exception as e:  # a corrupt file read by one rank stops every rank, none goes on to train
            error = e
        raise_on_every_rank(error, f"Loading checkpoint {path}")
        return loaded

    def remove_checkpoint(self, path: str | Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def teardown(self) -> None:
        """Finish every async save in flight and stop the background writer."""
        self.order_after_staging()
        if self.async_calls is not None:
            try:
                self.maybe_finalize(blocking=True)
            finally:
                self.async_calls.close()
                self.async_calls = self._new_async_queue()

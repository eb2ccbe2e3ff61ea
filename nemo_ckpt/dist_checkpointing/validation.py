"""Checks before saving and loading: sharding integrity, strict key matching, strategy choice."""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .core import CONFIG_FNAME, CheckpointingException, parse_config
from .dict_utils import diff, extract_matching_values, nested_values
from .integrity import check_directory, read_verified
from .mapping import (
    CommonStateDict,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    flat_range_boxes,
    is_main_replica,
)
from .strategies.base import LoadCommonStrategy, LoadShardedStrategy
from .strategies.defaults import default_load_common_strategy, default_load_sharded_strategy
from .utils import dist_ready

logger = logging.getLogger(__name__)

LocalMetadata = list[ShardedTensor | ShardedObject]
GlobalMetadata = list[LocalMetadata]


class StrictHandling(Enum):
    """What `load` does about keys that differ between the request and the checkpoint.

    "Unexpected" keys are requested but absent from the checkpoint; "missing" keys are in
    the checkpoint but requested by no rank. `*_UNEXPECTED` values skip the (global)
    missing-keys check. Every value except ASSUME_OK_UNEXPECTED reads the checkpoint
    metadata first and drops unexpected keys from the load.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether `val` compares the request with the checkpoint metadata."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """Whether `val` needs every rank's requested keys (to find missing keys)."""
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether `load` returns `(state_dict, missing_keys, unexpected_keys)`."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | bool | StrictHandling) -> StrictHandling:
    """StrictHandling from a value or its string; `True`/`False` mean ASSUME_OK_UNEXPECTED/LOG_UNEXPECTED."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError) as e:
        valid = [s.value for s in StrictHandling]
        raise ValueError(f"Invalid strict flag {strict!r}; expected one of {valid}") from e


def determine_global_metadata(sharded_state_dict: ShardedStateDict) -> tuple[LocalMetadata, GlobalMetadata]:
    """This rank's ShardedBase objects without data, and the same for every rank (all-gather)."""
    local_metadata = [sh_base.without_data() for sh_base in nested_values(sharded_state_dict)]
    if not dist_ready():
        return local_metadata, [local_metadata]
    global_metadata: GlobalMetadata = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(global_metadata, local_metadata)
    return local_metadata, global_metadata


def validate_sharding_integrity(
    global_metadata: GlobalMetadata, common_state_dict: CommonStateDict | None = None
) -> None:
    """Raise one CheckpointingException listing every sharding error.

    Main replicas of each ShardedTensor key must tile the global tensor exactly (no
    overlap, nothing missing, in bounds) and agree on global shape and dtype; each
    ShardedObject position must have exactly one main replica. Every rank runs the same
    check on the same gathered metadata, so all ranks raise together. With
    `common_state_dict`, a rank whose common state differs from rank 0 logs a warning.
    """
    if common_state_dict is not None:
        _validate_common_state_dict(common_state_dict)
    key_shardings: dict[str, list[tuple[int, ShardedBase]]] = defaultdict(list)
    for rank, rank_metadata in enumerate(global_metadata):
        for sh_base in rank_metadata:
            key_shardings[sh_base.key].append((rank, sh_base))
    errors = []
    for key, shardings in key_shardings.items():
        kinds = {type(sh) for _, sh in shardings}
        if len(kinds) > 1:
            errors.append(f"key '{key}': used both as ShardedTensor and ShardedObject")
        elif isinstance(shardings[0][1], ShardedObject):
            errors += _validate_objects_for_key(key, shardings)
        else:
            errors += _validate_sharding_for_key(key, shardings)
    if errors:
        raise CheckpointingException("Invalid sharding pattern:\n  " + "\n  ".join(errors))


def _boxes(sh_ten: ShardedTensor) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    p = sh_ten.prepend_axis_num
    if sh_ten.flattened_range is None:
        return [(sh_ten.global_offset, (1,) * p + sh_ten.local_shape)]
    rng = sh_ten.flattened_range
    return [
        (sh_ten.global_offset[:p] + tuple(g + o for g, o in zip(sh_ten.global_offset[p:], off)), (1,) * p + size)
        for off, size in flat_range_boxes(sh_ten.local_shape, rng.start, rng.stop)
    ]


def _overlap(a: tuple, b: tuple) -> bool:
    (a_off, a_size), (b_off, b_size) = a, b
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size))


def _validate_sharding_for_key(key: str, shardings: list[tuple[int, ShardedTensor]]) -> list[str]:
    first_rank, first = shardings[0]
    errors = []
    for rank, sh_ten in shardings:
        for attr in ("global_shape", "dtype"):
            if getattr(sh_ten, attr) != getattr(first, attr):
                errors.append(
                    f"key '{key}': {attr} {getattr(sh_ten, attr)} on rank {rank} differs from "
                    f"{getattr(first, attr)} on rank {first_rank}"
                )
    if errors:
        return errors
    global_shape = first.global_shape
    main = []  # (offset, size, rank)
    for rank, sh_ten in shardings:
        for off, size in _boxes(sh_ten):
            if any(o < 0 or o + s > g for o, s, g in zip(off, size, global_shape)):
                errors.append(
                    f"key '{key}': shard at offset {off} size {size} on rank {rank} is outside global shape "
                    f"{global_shape}"
                )
            elif is_main_replica(sh_ten.replica_id) and math.prod(size) > 0:
                main.append((off, size, rank))
    if errors:
        return errors
    # sweep along axis 0 (the usual sharding axis) to find overlaps
    main.sort(key=lambda b: b[0])
    active: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    for box in main:
        active = [a for a in active if not a[0] or a[0][0] + a[1][0] > box[0][0]]
        for other in active:
            if _overlap(box[:2], other[:2]):
                errors.append(
                    f"key '{key}': main replicas overlap: offset {other[0]} size {other[1]} on rank {other[2]} "
                    f"and offset {box[0]} size {box[1]} on rank {box[2]} (check replica_id)"
                )
        active.append(box)
    covered = sum(math.prod(size) for _, size, _ in main)
    total = math.prod(global_shape)
    if not errors and covered != total:
        ranks = sorted({rank for _, _, rank in main})
        errors.append(
            f"key '{key}': main replicas cover {covered} of {total} elements of global shape {global_shape} "
            f"(missing shards; main replicas are on ranks {ranks}, all ranks holding the key: "
            f"{sorted({r for r, _ in shardings})})"
        )
    return errors


def _validate_objects_for_key(key: str, shardings: list[tuple[int, ShardedObject]]) -> list[str]:
    first_rank, first = shardings[0]
    errors = []
    mains: dict[str, list[int]] = defaultdict(list)
    for rank, sh_obj in shardings:
        if sh_obj.global_shape != first.global_shape:
            errors.append(
                f"key '{key}': object global_shape {sh_obj.global_shape} on rank {rank} differs from "
                f"{first.global_shape} on rank {first_rank}"
            )
        elif any(not 0 <= o < s for o, s in zip(sh_obj.global_offset, sh_obj.global_shape)):
            errors.append(
                f"key '{key}': object offset {sh_obj.global_offset} on rank {rank} is outside {sh_obj.global_shape}"
            )
        elif is_main_replica(sh_obj.replica_id):
            mains[sh_obj.unique_key].append(rank)
    if errors:
        return errors
    for unique_key, ranks in mains.items():
        if len(ranks) > 1:
            errors.append(
                f"key '{key}': object {unique_key} has main replicas on several ranks {ranks} (check replica_id)"
            )
    expected = math.prod(first.global_shape)
    if len(mains) != expected:
        errors.append(
            f"key '{key}': {len(mains)} of {expected} objects of global shape {first.global_shape} have a main replica "
            f"(missing shards; ranks holding the key: {sorted({r for r, _ in shardings})})"
        )
    return errors


def _validate_common_state_dict(common_state_dict: CommonStateDict) -> None:
    """Warn if this rank's common state differs from rank 0's (rank 0's is what is saved)."""
    if not dist_ready():
        return
    objs = [common_state_dict if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    if dist.get_rank() > 0:
        only_rank0, only_here, mismatch = diff(objs[0], common_state_dict)
        if only_rank0 or only_here or mismatch:
            logger.warning(
                "Rank %d common state dict differs from rank 0 (only rank 0 is saved). Keys only on rank 0: %s, "
                "only on this rank: %s, mismatched: %s",
                dist.get_rank(),
                only_rank0,
                only_here,
                mismatch,
            )


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """Raise if neither strategy can handle ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise CheckpointingException(
            f"Either sharded strategy or common strategy must implement ShardedObjects handling."
            f" Both {sharded_strategy} and {common_strategy} specify can_handle_sharded_objects=False"
        )


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    verify: bool = True,
) -> tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Check that `checkpoint_dir` is a checkpoint and pick load strategies from its metadata.json (checked against
    its checksum with `verify`; a checkpoint saved with checksums that lost them raises `MissingChecksumsError`)."""
    check_directory(checkpoint_dir)
    if not os.path.isfile(os.path.join(checkpoint_dir, CONFIG_FNAME)):
        raise CheckpointingException(
            f"{checkpoint_dir} is not a distributed checkpoint: {os.path.join(checkpoint_dir, CONFIG_FNAME)} is missing"
        )
    data = read_verified(checkpoint_dir, CONFIG_FNAME, verify)
    config = parse_config(data, os.path.join(checkpoint_dir, CONFIG_FNAME))
    if sharded_strategy is None:
        sharded_strategy = default_load_sharded_strategy(config.sharded_backend, config.sharded_backend_version)
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = default_load_sharded_strategy(*sharded_strategy)
    if common_strategy is None:
        common_strategy = default_load_common_strategy(config.common_backend, config.common_backend_version)
    elif isinstance(common_strategy, tuple):
        common_strategy = default_load_common_strategy(*common_strategy)
    sharded_strategy.check_backend_compatibility(config.sharded_backend)
    sharded_strategy.check_version_compatibility(config.sharded_backend_version)
    common_strategy.check_backend_compatibility(config.common_backend)
    common_strategy.check_version_compatibility(config.common_backend_version)
    return sharded_strategy, common_strategy


def adjust_non_strict_load(sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: set[str]) -> ShardedStateDict:
    """`sharded_state_dict` without the ShardedBase objects whose key is in `sharded_keys_to_remove`."""
    _, kept = extract_matching_values(sharded_state_dict, lambda x: x.key in sharded_keys_to_remove)
    return kept


def _determine_missing_and_unexpected_keys(
    ckpt_sharded_metadata: ShardedStateDict,
    local_metadata: LocalMetadata,
    global_metadata: GlobalMetadata | None = None,
) -> tuple[set[str], set[str]]:
    """Unexpected keys (this rank's requests absent from the checkpoint) and missing keys
    (checkpoint keys nobody requested; empty without `global_metadata`)."""
    local_keys = {sh_base.key for sh_base in local_metadata}
    ckpt_keys = {sh_base.key for sh_base in ckpt_sharded_metadata.values()}
    unexpected_keys = local_keys - ckpt_keys
    missing_keys: set[str] = set()
    if global_metadata is not None:
        global_keys = {sh_base.key for rank_md in global_metadata for sh_base in rank_md}
        missing_keys = ckpt_keys - global_keys
    return missing_keys, unexpected_keys


def maybe_report_missing_and_unexpected_keys(
    missing_keys: set[str], unexpected_keys: set[str], raise_error: bool = True
) -> None:
    """Raise (or log a warning) if there are missing or unexpected keys."""
    if not missing_keys and not unexpected_keys:
        return
    msg = ""
    if missing_keys:
        msg += (
            "Some keys found in the checkpoint are missing in the provided sharded state dict. "
            f"Missing keys (for all ranks): {sorted(missing_keys)}. "
        )
    if unexpected_keys:
        msg += (
            "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict. "
            f"Unexpected keys (for this rank): {sorted(unexpected_keys)}. "
        )
    if raise_error:
        raise CheckpointingException(msg)
    logger.warning(msg)


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: LocalMetadata | None = None,
    global_metadata: GlobalMetadata | None = None,
    ckpt_sharded_metadata: ShardedStateDict | None = None,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Apply `strict` handling and the sharding check; returns (state dict without
    unexpected keys, missing keys, unexpected keys)."""
    missing_keys: set[str] = set()
    unexpected_keys: set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException("Cannot verify checkpoint mismatch with ckpt_sharded_metadata=None.")
        if local_metadata is None:
            local_metadata = [sh_base.without_data() for sh_base in nested_values(sharded_state_dict)]
        skip_missing = not StrictHandling.requires_global_app_metadata(strict)
        missing_keys, unexpected_keys = _determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata, local_metadata, None if skip_missing else global_metadata
        )
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected_keys)
        if strict == StrictHandling.IGNORE_ALL:
            missing_keys, unexpected_keys = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, False)
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException("Cannot check sharding integrity without global_metadata (None).")
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing_keys, unexpected_keys

"""Entry points: `save` and `load` (replacements for torch.save/torch.load) and
metadata-only readers.

`load` needs a sharded state dict as a template: its ShardedTensors say which parts of
which global tensors each rank wants.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .core import CONFIG_FNAME, CheckpointingConfig, CheckpointingException, config_document, save_config
from .dict_utils import extract_matching_values, merge
from .fault_points import pause_point
from .integrity import record_file_checksum
from .mapping import (
    CommonStateDict,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factory_merges,
)
from .state_dict_utils import load_preprocess, save_preprocess
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
)
from .strategies.defaults import get_default_save_common_strategy, get_default_save_sharded_strategy
from .strategies.torch import COMMON_STATE_KEY
from .utils import barrier, extract_sharded_base, get_rank
from .validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    validate_sharded_objects_handling,
    verify_checkpoint_and_load_strategy,
)

logger = logging.getLogger(__name__)

CkptShardedMetadata = dict[str, ShardedTensor | ShardedObject]
_CONTENT_METADATA_KEY = "content_metadata"


def _configured(strategy: Any, allow_unsafe_pickle: bool, verify: bool) -> Any:
    """`strategy` (or a copy, also of the strategy it wraps) that may unpickle anything if `allow_unsafe_pickle`,
    and checks checksums as `verify` says, where it supports these."""
    base = getattr(strategy, "base_strategy", None)
    if base is not None:
        configured = _configured(base, allow_unsafe_pickle, verify)
        if configured is base:
            return strategy
        strategy = copy.copy(strategy)
        strategy.base_strategy = configured
        return strategy
    changes = {"verify_checksums": verify} | ({"allow_unsafe_pickle": True} if allow_unsafe_pickle else {})
    changes = {name: value for name, value in changes.items() if hasattr(strategy, name)}
    if all(getattr(strategy, name) == value for name, value in changes.items()):
        return strategy
    strategy = copy.copy(strategy)
    for name, value in changes.items():
        setattr(strategy, name, value)
    return strategy


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    allow_unsafe_pickle: bool = False,
    verify: bool = True,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load the parts of a checkpoint described by `sharded_state_dict`.

    Steps: load the common state (base of the result); apply factories; add unwrapped
    LocalNonpersistentObjects; load ShardedObjects and ShardedTensors; undo factories.

    Args:
        sharded_state_dict: template with ShardedTensors (data is loaded into their
            `data` when given) and other sharded entities.
        checkpoint_dir: checkpoint directory.
        sharded_strategy: load strategy or (backend, version); default from metadata.json.
        common_strategy: common load strategy or (backend, version); default from metadata.json.
        validate_access_integrity: check (collectively) that main replicas tile every tensor.
        strict: a `StrictHandling` value (or its string) for key mismatches.
        allow_unsafe_pickle: unpickle common data and ShardedObjects without the
            allow-list. Only for trusted checkpoints.
        verify: check every byte read against the checksums stored at save (`integrity.py`), as it is read, and
            raise `CorruptCheckpointError` naming each corrupt file and byte range before returning anything;
            checkpoints of other tools (no checksums) load as usual, ours whose `checksums.json` is missing raise
            `MissingChecksumsError`. False: nothing is checked.

    Returns:
        The state dict, or `(state_dict, missing_keys, unexpected_keys)` for
        `return_unexpected`/`return_all`.
    """
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy, verify
    )
    sharded_strategy = _configured(sharded_strategy, allow_unsafe_pickle, verify)
    common_strategy = _configured(common_strategy, allow_unsafe_pickle, verify)
    checkpoint_dir = Path(checkpoint_dir)

    common_state_dict = common_strategy.load_common(checkpoint_dir)
    sharded_state_dict, nonpersistent_state_dict, sh_ten_factories = load_preprocess(sharded_state_dict)
    merge(common_state_dict, nonpersistent_state_dict)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)

    strict = parse_strict_flag(strict)
    ckpt_sharded_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_sharded_metadata = load_sharded_metadata(checkpoint_dir, sharded_strategy, common_strategy)
        ckpt_sharded_metadata = {k: v for k, v in ckpt_sharded_metadata.items() if v.key != COMMON_STATE_KEY}
    local_metadata, global_metadata = None, None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_metadata, global_metadata = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, missing_keys, unexpected_keys = validate_integrity_and_strict_load(
        sharded_state_dict, strict, validate_access_integrity, local_metadata, global_metadata, ckpt_sharded_metadata
    )

    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        sharded_objects, sharded_state_dict = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, ShardedObject)
        )
        merge(common_state_dict, common_strategy.load_sharded_objects(sharded_objects, checkpoint_dir))

    loaded_state_dict = sharded_strategy.load(sharded_state_dict, checkpoint_dir)
    merge(common_state_dict, loaded_state_dict)
    apply_factory_merges(common_state_dict, sh_ten_factories)

    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state_dict, missing_keys, unexpected_keys
    return common_state_dict


def get_default_load_sharded_strategy(checkpoint_dir: str | Path, verify: bool = True) -> LoadShardedStrategy:
    """The load strategy of the format `checkpoint_dir` was saved in (from its metadata.json), checking checksums
    as `verify` says."""
    return _configured(verify_checkpoint_and_load_strategy(checkpoint_dir, verify=verify)[0], False, verify)


def load_common_state_dict(
    checkpoint_dir: str | Path, allow_unsafe_pickle: bool = False, verify: bool = True
) -> StateDict:
    """Only the common (non-sharded) state dict of a checkpoint: no tensor data is read."""
    _, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir, verify=verify)
    return _configured(common_strategy, allow_unsafe_pickle, verify).load_common(Path(checkpoint_dir))


def load_tensors_metadata(
    checkpoint_dir: str | Path, sharded_strategy: LoadShardedStrategy | None = None
) -> CkptShardedMetadata:
    """`{key: ShardedTensor without data}` for every stored tensor, each as one shard of
    its full global shape (useful to learn shapes and dtypes, or to load whole tensors)."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return sharded_strategy.load_tensors_metadata(Path(checkpoint_dir))


def load_sharded_metadata(
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
) -> CkptShardedMetadata:
    """Like `load_tensors_metadata` plus ShardedObjects (keyed by unique key)."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy
    )
    sharded_metadata = sharded_strategy.load_sharded_metadata(Path(checkpoint_dir))
    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        sharded_metadata.update(common_strategy.load_sharded_metadata(Path(checkpoint_dir)))
    return sharded_metadata


def load_plain_tensors(checkpoint_dir: str | Path) -> StateDict:
    """Every stored tensor, whole, keyed by its checkpoint key (common state not included)."""
    sharded_state_dict = load_tensors_metadata(checkpoint_dir)
    # every rank reads whole tensors, so shards overlap on purpose
    loaded = load(sharded_state_dict, checkpoint_dir, validate_access_integrity=False)
    return {k: v for k, v in loaded.items() if k in sharded_state_dict}


def load_content_metadata(
    checkpoint_dir: str | Path | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    """The `content_metadata` given to `save`, or None if there is none."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("Both checkpoint_dir and preloaded_state_dict cannot be None")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | Path,
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None = None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
    content_metadata: dict | None = None,
    async_sharded_save: bool = False,
) -> AsyncRequest | None:
    """Save a sharded state dict (collective: every rank calls it with its shards).

    Steps: apply factories; drop LocalNonpersistentObjects; validate the sharding across
    ranks (before anything is written); rank 0 saves the common part (`common.pt` and,
    for Megatron-Core >= 0.19 readers, a `common_state` ShardedObject); save
    ShardedObjects and ShardedTensors; finally rank 0 writes `metadata.json`, so an
    interrupted save never looks like a checkpoint.

    Args:
        sharded_state_dict: state dict with ShardedTensors etc. Modified in place
            (factories applied, `content_metadata` added).
        checkpoint_dir: existing directory to save into.
        sharded_strategy: save strategy or (backend, version); default ('torch_dist', 1).
        common_strategy: common save strategy or (backend, version); default ('torch', 1).
        validate_access_integrity: validate the sharding across ranks (collective).
        preprocess_common_before_consistancy_check: maps the common state dict before the
            cross-rank consistency check (e.g. to drop keys expected to differ).
        content_metadata: application metadata, read back with `load_content_metadata`.
        async_sharded_save: return an `AsyncRequest` instead of writing the shards now: the
            data is staged on CPU (the common state serialized in memory), the request writes it
            all and its finalize functions (the last one writes `metadata.json`) complete the
            checkpoint. Needs a strategy with `async_save`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_save_sharded_strategy(*sharded_strategy)
    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_save_common_strategy(*common_strategy)

    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
    sharded_state_dict, common_state_dict = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check
    )

    if get_rank() == 0:
        _remove_stale_config(checkpoint_dir)
    barrier()
    if async_sharded_save:
        write_common = common_strategy.save_common_async(common_state_dict, checkpoint_dir)
    else:
        common_strategy.save_common(common_state_dict, checkpoint_dir)
    if sharded_strategy.can_handle_sharded_objects:
        sharded_state_dict[COMMON_STATE_KEY] = ShardedObject(
            COMMON_STATE_KEY, common_state_dict, (1,), (0,), replica_id=get_rank()
        )
    else:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        sharded_objects, sharded_state_dict = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, ShardedObject)
        )
        common_strategy.save_sharded_objects(sharded_objects, checkpoint_dir)
    config = CheckpointingConfig(
        sharded_strategy.backend, sharded_strategy.version, common_strategy.backend, common_strategy.version
    )
    if not async_sharded_save:
        sharded_strategy.save(sharded_state_dict, checkpoint_dir)
        _finalize_save(config, checkpoint_dir)
        return None
    if not hasattr(sharded_strategy, "async_save"):
        raise CheckpointingException(
            f"async_sharded_save=True needs a strategy with `async_save`; {sharded_strategy} has none"
        )
    async_request = _then_write(sharded_strategy.async_save(sharded_state_dict, checkpoint_dir), write_common)
    async_request.add_finalize_fn(lambda: _finalize_save(config, checkpoint_dir))
    return async_request


def _then_write(request: AsyncRequest, write: Callable[[], None]) -> AsyncRequest:
    """`request` whose background part also runs `write` (the common state's durable write), after its own."""

    def write_all(*args: Any, **kwargs: Any) -> None:
        if request.async_fn is not None:
            request.async_fn(*args, **kwargs)
        write()

    return request._replace(async_fn=write_all)


def _finalize_save(config: CheckpointingConfig, checkpoint_dir: Path) -> None:
    """Once every rank's data is written, rank 0 adds the checksum of metadata.json to the checkpoint's (if any)
    and writes metadata.json, the completeness marker."""
    barrier()
    if get_rank() == 0:
        pause_point("before-metadata-json")
        record_file_checksum(checkpoint_dir, CONFIG_FNAME, config_document(config))
        save_config(config, checkpoint_dir)
    barrier()


def _remove_stale_config(checkpoint_dir: Path) -> None:
    """Remove an old metadata.json so a failed overwrite is not mistaken for a checkpoint."""
    config_path = checkpoint_dir / CONFIG_FNAME
    if config_path.exists():
        logger.warning("Overwriting checkpoint %s", checkpoint_dir)
        os.remove(config_path)

"""Steps shared by save and load: applying factories and splitting off non-sharded parts."""

from __future__ import annotations

from collections.abc import Callable

from .dict_utils import dict_list_map_inplace
from .mapping import (
    CommonStateDict,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
)
from .utils import extract_matching_values, extract_nonpersistent, extract_sharded_base
from .validation import determine_global_metadata, validate_sharding_integrity


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
) -> tuple[ShardedStateDict, StateDict]:
    """Apply factories, drop LocalNonpersistentObjects and split (sharded part, common part).

    With `validate_access_integrity` the sharding is validated across ranks (collective)
    before anything is written.
    """
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(sharded_state_dict)
    if validate_access_integrity:
        preprocessed_common = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            preprocessed_common = preprocess_common_before_consistancy_check(common_state_dict)
        _, global_metadata = determine_global_metadata(sharded_part)
        validate_sharding_integrity(global_metadata, preprocessed_common)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict, dict]:
    """Apply factories (keeping them for the merge) and unwrap LocalNonpersistentObjects.

    Returns (sharded state dict, unwrapped non-persistent objects, factories).
    """
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return sharded_state_dict, nonpersistent, factories

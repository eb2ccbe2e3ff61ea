"""Save and load strategies, registered by (backend, version)."""

from .base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)

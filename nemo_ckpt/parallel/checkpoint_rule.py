"""`CheckpointRule`: what one parallelism changes in a checkpoint's description of the live state.

By default an entry of the model's state dict is replicated over the data-parallel (dp x cp) ranks and written by
dp x cp rank 0, and the optimizer's state is sharded like its parameter (`nemo_ckpt.strategy.state_dict`). Each
parallelism that departs from that has a rule beside it (`expert_parallel.ExpertCheckpointRule`,
`pipeline.PipelineCheckpointRule`, `fsdp.ShardedStagesRule`, `zero.ZeroOneSharding`); the strategy applies the
active ones in order, later rules overriding earlier replica ids. The defaults here change nothing.
"""

from typing import Any

from torch import nn
from torch.optim import Optimizer


class CheckpointRule:
    """The hooks a parallelism may override."""

    def replica_ids(self, state_dict: dict[str, Any]) -> dict[str, int]:
        """Replica ids of some model keys, overriding the dp x cp rank (0 marks the copy that is written)."""
        return {}

    def complete_optimizer_state(
        self, optimizer: Optimizer, state: dict[str, Any], names: dict[nn.Parameter, str]
    ) -> dict[str, Any]:
        """This rank's `named_optimizer_state` of `optimizer`, completed to describe what this rank alone does not
        hold, as the common part of a checkpoint must."""
        return state

    def optimizer_replica_id(self, optimizer: Optimizer) -> int | None:
        """The replica id of `optimizer`'s parameter-shaped state (None: its parameter's)."""
        return None

    def finish_optimizer_state(self, sharded: dict[str, Any]) -> None:
        """Change the sharded optimizer state dict in place (after its tensors are `ShardedTensor`s)."""

"""Megatron-Core compatible distributed checkpointing on torch.distributed.checkpoint.

Swap `from megatron.core import dist_checkpointing` for
`from nemo_ckpt import dist_checkpointing`.
"""

from .core import CheckpointingException, check_is_distributed_checkpoint
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from .serialization import (
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
from .validation import StrictHandling

__all__ = [
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedBase",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StrictHandling",
    "check_is_distributed_checkpoint",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "save",
]

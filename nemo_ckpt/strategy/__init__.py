"""The Lightning strategy: `MegatronStrategy`, its `DistCheckpointIO`, the sharded state dicts it saves and loads
(`state_dict`), and tensor- and pipeline-parallel communication overlap (`comm_overlap`)."""

from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions
from nemo_ckpt.strategy.comm_overlap import MegatronCommOverlapCallback
from nemo_ckpt.strategy.megatron_strategy import MegatronStrategy

__all__ = ["DistCheckpointIO", "DistCheckpointOptions", "MegatronCommOverlapCallback", "MegatronStrategy"]

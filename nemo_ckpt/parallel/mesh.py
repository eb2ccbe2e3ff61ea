"""The device mesh of a run: (dp, tp), tensor-parallel ranks adjacent, as in Megatron-Core."""

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DATA_PARALLEL_DIM = "dp"
TENSOR_PARALLEL_DIM = "tp"


def build_device_mesh(device_type: str, tensor_model_parallel_size: int, world_size: int | None = None) -> DeviceMesh:
    """A 2-D (dp, tp) mesh over all ranks; tp ranks are adjacent (fastest links), as in Megatron-Core."""
    world_size = world_size or dist.get_world_size()
    if tensor_model_parallel_size < 1 or world_size % tensor_model_parallel_size:
        raise ValueError(
            f"tensor_model_parallel_size={tensor_model_parallel_size} must be >= 1 and divide the world size "
            f"{world_size}; choose a divisor of the number of processes"
        )
    shape = (world_size // tensor_model_parallel_size, tensor_model_parallel_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=(DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM))

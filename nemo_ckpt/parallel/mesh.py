"""The device mesh of a run: (pp, dp, cp, tp), and the expert mesh (pp, edp, ep, tp) carved from it.

Rank order follows Megatron-Core's default (`tp-cp-ep-dp-pp`): tensor-parallel ranks adjacent (fastest links), then
context-parallel, then data-parallel, pipeline stages outermost. Expert parallelism splits the dp x cp ranks
(which hold the same dense weights) into `ep` groups of adjacent ranks; `edp` is what remains for expert data
parallelism.
"""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nemo_ckpt._compat import flatten_mesh_dims

PIPELINE_PARALLEL_DIM = "pp"
DATA_PARALLEL_DIM = "dp"
CONTEXT_PARALLEL_DIM = "cp"
TENSOR_PARALLEL_DIM = "tp"
DATA_CONTEXT_PARALLEL_DIM = "dp_cp"
"""dp x cp flattened: ranks holding the same weights, over which gradients are reduced and FSDP shards."""
EXPERT_DATA_PARALLEL_DIM = "edp"
EXPERT_PARALLEL_DIM = "ep"


PARALLEL_SIZE_OPTIONS = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
}
"""`ParallelDims`' sizes and the `MegatronStrategy` options that set them."""


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of each parallel dimension; `dp` is what the world size leaves after the others."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for dim, option in PARALLEL_SIZE_OPTIONS.items():
            if getattr(self, dim) < 1:
                raise ValueError(f"{option}={getattr(self, dim)} must be 1 or more")
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise ValueError(
                f"tensor_model_parallel_size={self.tp} x pipeline_model_parallel_size={self.pp} x "
                f"context_parallel_size={self.cp} = {model_parallel} must divide the world size {self.world_size}; "
                "choose sizes whose product divides the number of processes"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"expert_model_parallel_size={self.ep} must divide data_parallel_size x context_parallel_size = "
                f"{self.dp} x {self.cp} (world size {self.world_size} / (tp={self.tp} x pp={self.pp})); "
                "choose a divisor of it"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.dp * self.cp // self.ep

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The (pp, dp, cp, tp) mesh."""
        return init_device_mesh(
            device_type,
            (self.pp, self.dp, self.cp, self.tp),
            mesh_dim_names=(PIPELINE_PARALLEL_DIM, DATA_PARALLEL_DIM, CONTEXT_PARALLEL_DIM, TENSOR_PARALLEL_DIM),
        )

    @staticmethod
    def data_context_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
        """dp x cp of `mesh` (from `build_mesh`) as one dimension named `dp_cp`; keep it, as torch wants."""
        return flatten_mesh_dims(mesh, (DATA_PARALLEL_DIM, CONTEXT_PARALLEL_DIM), DATA_CONTEXT_PARALLEL_DIM)

    def build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """The (pp, edp, ep, tp) mesh of expert parameters: each ep group is `ep` adjacent ranks of dp x cp."""
        return init_device_mesh(
            device_type,
            (self.pp, self.edp, self.ep, self.tp),
            mesh_dim_names=(PIPELINE_PARALLEL_DIM, EXPERT_DATA_PARALLEL_DIM, EXPERT_PARALLEL_DIM, TENSOR_PARALLEL_DIM),
        )


def build_device_mesh(device_type: str, tensor_model_parallel_size: int, world_size: int | None = None) -> DeviceMesh:
    """The mesh of a run with tensor parallelism only (pp = cp = 1): dims pp, dp, cp, tp."""
    dims = ParallelDims(world_size or dist.get_world_size(), tp=tensor_model_parallel_size)
    return dims.build_mesh(device_type)

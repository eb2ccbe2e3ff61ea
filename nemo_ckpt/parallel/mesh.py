"""The layout of a run, asked in one place: `ParallelDims` holds each dimension's size, and after `build_meshes`
the device mesh (pp, dp, cp, tp), dp x cp flattened, and the expert mesh (pp, edp, ep, tp) carved from it, with
each dimension's ranks and groups. Data, logging and overlap code reach it through `parallel_dims_of(trainer)`.

Rank order follows Megatron-Core's default (`tp-cp-ep-dp-pp`): tensor-parallel ranks adjacent (fastest links), then
context-parallel, then data-parallel, pipeline stages outermost. Expert parallelism splits the dp x cp ranks
(which hold the same dense weights) into `ep` groups of adjacent ranks; `edp` is what remains for expert data
parallelism.
"""

from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class ParallelDims:
    """The sizes of each parallel dimension; `dp` is what the world size leaves after the others. After
    `build_meshes`, also the meshes: ask them here (`dp_mesh`, `tp_mesh`, ..., `dp_rank`), not a strategy."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    _meshes: "_Meshes | None" = field(default=None, init=False, repr=False, compare=False)

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

    def build_meshes(self, device_type: str) -> "ParallelDims":
        """Build and keep the run's meshes (a collective: every rank calls it once, after the process group
        starts); the expert mesh only when experts are split (`ep` > 1). Returns self."""
        mesh = self.build_mesh(device_type)
        expert_mesh = self.build_expert_mesh(device_type) if self.ep > 1 else None
        self._meshes = _Meshes(mesh, self.data_context_parallel_mesh(mesh), expert_mesh)
        return self

    @property
    def _built(self) -> "_Meshes":
        if self._meshes is None:
            raise RuntimeError("ParallelDims' meshes are built by build_meshes() (MegatronStrategy.setup_environment)")
        return self._meshes

    @property
    def mesh(self) -> DeviceMesh:
        """The (pp, dp, cp, tp) device mesh."""
        return self._built.mesh

    @property
    def pp_mesh(self) -> DeviceMesh:
        """Ranks holding consecutive pipeline stages of the same model replica."""
        return self.mesh[PIPELINE_PARALLEL_DIM]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """Ranks that read different batches (the data samplers shard over it)."""
        return self.mesh[DATA_PARALLEL_DIM]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """Ranks splitting each sequence (ring attention); they read the same batch and hold the same weights."""
        return self.mesh[CONTEXT_PARALLEL_DIM]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh[TENSOR_PARALLEL_DIM]

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """Ranks holding the same weights (dp x cp): gradients are reduced and FSDP/ZeRO-1 shard over it."""
        return self._built.dp_cp

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """The (pp, edp, ep, tp) mesh when experts are split (`ep` > 1), else None."""
        return self._built.expert

    @property
    def expert_replica_mesh(self) -> DeviceMesh:
        """Ranks holding the same experts: `edp` when experts are split, else dp x cp."""
        expert_mesh = self.expert_mesh
        return self.dp_cp_mesh if expert_mesh is None else expert_mesh[EXPERT_DATA_PARALLEL_DIM]

    @property
    def dp_rank(self) -> int:
        """This rank's index on `dp`; without meshes (a strategy with data parallelism only) the global rank."""
        if self._meshes is None and self.dp == self.world_size:
            return dist.get_rank() if dist.is_initialized() else 0
        return self.dp_mesh.get_local_rank()


@dataclass(frozen=True)
class _Meshes:
    mesh: DeviceMesh
    dp_cp: DeviceMesh
    expert: DeviceMesh | None


def parallel_dims_of(trainer: Any) -> ParallelDims:
    """The layout of `trainer`'s run: its strategy's `parallel_dims` (MegatronStrategy), else every rank data
    parallel (any other Lightning strategy)."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return dims if dims is not None else ParallelDims(trainer.world_size)


def build_device_mesh(device_type: str, tensor_model_parallel_size: int, world_size: int | None = None) -> DeviceMesh:
    """The mesh of a run with tensor parallelism only (pp = cp = 1): dims pp, dp, cp, tp."""
    dims = ParallelDims(world_size or dist.get_world_size(), tp=tensor_model_parallel_size)
    return dims.build_mesh(device_type)

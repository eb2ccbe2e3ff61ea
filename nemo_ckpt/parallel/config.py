"""`ParallelismConfig`: `MegatronStrategy`'s parallelism options, declared once and checked together when built.

The strategy takes these fields as its own flat keyword arguments (NeMo's names; `nemo_ckpt.options.flat_options`),
and NeMo's `MegatronStrategy.parallelism` returns the same kind of object. `dims(world_size)` derives the run's
`ParallelDims` (and so the data-parallel size) when the world size is known; `parallelism_of(trainer)` reads it
from any trainer.
"""

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from nemo_ckpt.parallel.context_parallel import check_context_parallel_options
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.expert_parallel import check_expert_parallel_options
from nemo_ckpt.parallel.mesh import ParallelDims
from nemo_ckpt.parallel.pipeline import PipelineConfig, check_pipeline_options


@dataclass(frozen=True)
class ParallelismConfig:
    """The parallel layout a run asks for (see `MegatronStrategy` for each option), with the data-parallel
    sharding (`ddp`) it must agree with.

    Built, it holds normalized values: `expert_tensor_parallel_size` resolved (None: the tensor-parallel size,
    as in Megatron-Core), `cp_comm_type` validated, and the pipeline options as a `PipelineConfig` (`pipeline`).
    """

    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    pipeline_dtype: torch.dtype | str | None = None
    pipeline_schedule: str | None = None
    context_parallel_size: int = 1
    cp_comm_type: str | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    pipeline: PipelineConfig = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pipeline = PipelineConfig(
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.microbatch_group_size_per_vp_stage,
            self.pipeline_dtype,
            self.pipeline_schedule,
        )
        object.__setattr__(self, "pipeline", pipeline)
        tp = self.tensor_model_parallel_size
        if tp < 1:
            raise ValueError(f"MegatronStrategy(tensor_model_parallel_size={tp}): use 1 or more")
        if self.sequence_parallel and tp == 1:
            raise ValueError(
                "MegatronStrategy(sequence_parallel=True) shards activations over tensor-parallel ranks; "
                "set tensor_model_parallel_size > 1 or sequence_parallel=False"
            )
        if tp > 1 and self.ddp.data_parallel_sharding_strategy == "optim":
            raise ValueError(
                "MegatronStrategy(tensor_model_parallel_size > 1) does not support "
                "data_parallel_sharding_strategy='optim' (ZeRO-1); use 'no_shard', 'optim_grads' or "
                "'optim_grads_params'"
            )
        expert_tensor_parallel_size = check_expert_parallel_options(
            self.expert_model_parallel_size,
            self.expert_tensor_parallel_size,
            tp,
            self.pipeline_model_parallel_size,
            self.ddp.data_parallel_sharding_strategy,
        )
        check_pipeline_options(self.pipeline, self.ddp)
        cp_comm_type = check_context_parallel_options(self.context_parallel_size, self.cp_comm_type)
        object.__setattr__(self, "expert_tensor_parallel_size", expert_tensor_parallel_size)
        object.__setattr__(self, "cp_comm_type", cp_comm_type)

    def with_pipeline_options(self, **options: bool) -> "ParallelismConfig":
        """This config with the pipeline's communication options (`MegatronCommOverlapCallback`'s) set."""
        config = replace(self)
        object.__setattr__(config, "pipeline", replace(self.pipeline, **options))  # validates them
        return config

    @property
    def sequence_shards(self) -> int:
        """How many pieces sequence parallelism cuts each cp rank's sequence chunk into (1 without it)."""
        return self.tensor_model_parallel_size if self.sequence_parallel else 1

    def compute_dtype(self, precision: str) -> torch.dtype | None:
        """bf16 under the Trainer's `precision="bf16-mixed"`, else None (compute in the parameters' dtype); an
        error for fp16 with loss scaling where this layout cannot scale the loss."""
        if precision == "16-mixed" and self.ddp.shards_parameters:
            raise ValueError(
                "MegatronStrategy: precision='16-mixed' (fp16 with loss scaling) is not supported with sharded "
                "gradients; use precision='bf16-mixed'"
            )
        if precision == "16-mixed" and self.pipeline.enabled:
            raise ValueError(
                f"MegatronStrategy: precision='16-mixed' (fp16 with loss scaling) is not supported with "
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size} (the schedule's "
                "backward does not scale the loss); use precision='bf16-mixed'"
            )
        return torch.bfloat16 if precision == "bf16-mixed" else None

    def dims(self, world_size: int) -> ParallelDims:
        """The sizes of every dimension on `world_size` ranks (the data-parallel size is what the others leave)."""
        return ParallelDims(
            world_size,
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_model_parallel_size,
            cp=self.context_parallel_size,
            ep=self.expert_model_parallel_size,
        )


PARALLELISM_OPTIONS = tuple(f.name for f in fields(ParallelismConfig) if f.init and f.name != "ddp")
"""The flat parallelism options of `MegatronStrategy` (`ddp` is its own argument, which also takes a name)."""


def parallelism_of(trainer: Any) -> ParallelismConfig:
    """The parallelism `trainer`'s strategy is configured with, known before the process group starts (the built
    layout, after it starts: `parallel_dims_of`); another Lightning strategy's is plain data parallelism."""
    parallelism = getattr(trainer.strategy, "parallelism", None)
    return parallelism if isinstance(parallelism, ParallelismConfig) else ParallelismConfig()

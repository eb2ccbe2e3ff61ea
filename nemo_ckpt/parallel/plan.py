"""Compose the parallelisms on a model in one order, for pipeline and non-pipeline runs alike.

`parallelize` reads top to bottom:

0. meta-device init: with a pipeline, a model still on `meta` records the RNG state each module starts from in the
   whole model, so the stages kept get the values an eager build gives them.
1. experts: each MoE layer keeps this rank's experts (ep) and learns its process groups.
2. pipeline: the model keeps this rank's stages.
3. context: attention runs as a ring over cp; the loss is reduced over cp (over dp x cp per token).
4. tensor / sequence: the model's own tensor-parallel plan over tp (it materializes the modules it shards).
5. activation recompute: the model's own (`GPTConfig.recompute_granularity`), inside the units below.
6. data parallel over dp x cp: FSDP2 (split experts over edp first) when parameters are sharded, else the
   parameters are materialized and the layout's gradient reduction chosen: DDP, or, where DDP cannot serve, a
   reducer called after each backward (DTensor gradients, split experts, pipeline stages). ZeRO-1 partitions the
   optimizers once they exist (`ParallelModel.shard_optimizers`).
7. pipeline schedule: the tied weight's group (its copies made equal) and the runner.

The result, a `ParallelModel`, holds what training needs, including each active parallelism's checkpoint rule.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer

from nemo_ckpt.parallel.checkpoint_rule import CheckpointRule
from nemo_ckpt.parallel.config import ParallelismConfig
from nemo_ckpt.parallel.context_parallel import apply_context_parallel
from nemo_ckpt.parallel.ddp import apply_ddp
from nemo_ckpt.parallel.expert_parallel import (
    ExpertCheckpointRule,
    ExpertParallelGradReducer,
    ExpertParallelLayer,
    apply_expert_parallel,
    shard_experts_fsdp,
)
from nemo_ckpt.parallel.fsdp import ShardedStagesRule, apply_fsdp
from nemo_ckpt.parallel.gradients import GradientAllReducer
from nemo_ckpt.parallel.mesh import PIPELINE_PARALLEL_DIM, ParallelDims
from nemo_ckpt.parallel.meta_init import default_generator, has_meta_tensors, materialize, record_init_rng_states
from nemo_ckpt.parallel.pipeline import (
    PipelineCheckpointRule,
    PipelineRunner,
    PipelineSplittable,
    StageGradientReducer,
    TiedWeight,
    tied_weight,
)
from nemo_ckpt.parallel.tensor_parallel import apply_tensor_parallel
from nemo_ckpt.parallel.zero import ZeroOneSharding

Stages = list[tuple[int, nn.Module]]


class GradientReducer(Protocol):
    """Completes the data-parallel reduction of the gradients after a backward."""

    def finish(self) -> Any: ...


@dataclass
class ParallelModel:
    """A parallelized model and what training needs of it."""

    module: nn.Module
    """What Lightning trains: the model, or DDP around it."""
    dims: ParallelDims
    pipeline: PipelineRunner | None = None
    grad_reducer: GradientReducer | None = None
    fsdp_modules: list[FSDPModule] = field(default_factory=list)
    tied_weight: TiedWeight | None = None
    checkpoint_rules: list[CheckpointRule] = field(default_factory=list)
    zero: list[ZeroOneSharding] = field(default_factory=list)

    def shard_optimizers(self, optimizers: list[Optimizer], module: nn.Module, overlap_param_gather: bool) -> None:
        """ZeRO-1: partition each optimizer's state over dp x cp (its checkpoint rule joins the others)."""
        group = self.dims.dp_cp_mesh.get_group()
        self.zero = [ZeroOneSharding(optimizer, module, group, overlap_param_gather) for optimizer in optimizers]

    @property
    def rules(self) -> list[CheckpointRule]:
        """The checkpoint rules of the active parallelisms, in the order they apply."""
        return [*self.checkpoint_rules, *self.zero]

    def finish_gradients(self) -> None:
        """Complete the gradients' reduction after a backward (or a pipeline step)."""
        if self.grad_reducer is not None:
            self.grad_reducer.finish()
        if self.tied_weight is not None:
            self.tied_weight.all_reduce_grad()

    def settle(self) -> None:
        """Finish pending ZeRO-1 broadcasts and reshard FSDP2 units, so parameters are current and sharded."""
        for zero in self.zero:
            zero.wait_for_params()
        for module in self.fsdp_modules:
            module.reshard()


def parallelize(
    model: nn.Module,
    config: ParallelismConfig,
    dims: ParallelDims,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    num_microbatches: int,
    ddp_kwargs: dict[str, Any],
) -> ParallelModel:
    """Apply every parallelism of `config` to `model` (a LightningModule) on the meshes of `dims`, in place, in the
    order of the module docstring. `compute_dtype`: bf16 under mixed precision (None: the parameters' dtype).
    `num_microbatches`: what a pipeline step runs. `ddp_kwargs`: torch DDP's arguments (`device_ids`, ...), where
    DDP is used."""
    pipelined = config.pipeline.enabled
    init_end = record_init_rng_states(model, device) if pipelined and has_meta_tensors(model) else None
    moe_layers = _split_experts(model, config, dims)
    stages = _split_pipeline(model, config, dims) if pipelined else None
    apply_context_parallel(model, dims.cp_mesh, dims.dp_cp_mesh, config.cp_comm_type, config.sequence_shards)
    if config.tensor_model_parallel_size > 1:
        apply_tensor_parallel(model, dims.tp_mesh, config.sequence_parallel, device)
    if config.ddp.shards_parameters:
        parallel = _shard(model, config, dims, device, compute_dtype, moe_layers, stages)
    else:
        parallel = _replicate(model, config, dims, device, compute_dtype, num_microbatches, stages, ddp_kwargs)
    parallel.checkpoint_rules.append(ExpertCheckpointRule(model, dims))
    if init_end is not None:
        default_generator(device).set_state(init_end)  # where building the whole model leaves it
    if stages is not None:
        parallel.tied_weight = tied_weight(model, dims.mesh, PIPELINE_PARALLEL_DIM)
        if parallel.tied_weight is not None:
            parallel.tied_weight.broadcast()
        pipeline_group = dims.pp_mesh.get_group()
        rank = dims.dp_cp_mesh.get_local_rank()
        parallel.checkpoint_rules.append(PipelineCheckpointRule(parallel.tied_weight, pipeline_group, rank))
        loss = model.pipeline_loss
        parallel.pipeline = PipelineRunner(config.pipeline, stages, dims.pp_mesh, device, num_microbatches, loss)
    return parallel


def _split_experts(model: nn.Module, config: ParallelismConfig, dims: ParallelDims) -> list[ExpertParallelLayer]:
    """Keep this rank's experts (ep > 1) and give the MoE layers their process groups."""
    dp_cp_mesh = dims.dp_cp_mesh
    layers = apply_expert_parallel(
        model,
        dims.expert_mesh,
        dp_cp_mesh.get_group() if dp_cp_mesh.size() > 1 else None,
        expert_tensor_parallel=config.expert_tensor_parallel_size > 1,
    )
    if dims.expert_mesh is not None and not layers:
        raise ValueError(
            f"MegatronStrategy(expert_model_parallel_size={dims.ep}) needs a model with experts "
            "(GPTConfig.num_moe_experts); set expert_model_parallel_size=1 for a dense model"
        )
    return layers


def _split_pipeline(model: nn.Module, config: ParallelismConfig, dims: ParallelDims) -> Stages:
    if not isinstance(model, PipelineSplittable):
        raise TypeError(
            f"pipeline_model_parallel_size > 1 needs a model that splits itself into stages (a `split_pipeline` "
            f"method, as nemo_ckpt's GPTModel has); {type(model).__name__} has none"
        )
    return model.split_pipeline(dims.pp_mesh, config.pipeline.virtual_size)


def _shard(
    model: nn.Module,
    config: ParallelismConfig,
    dims: ParallelDims,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    moe_layers: list[ExpertParallelLayer],
    stages: Stages | None,
) -> ParallelModel:
    """FSDP2 over dp x cp of the pipeline stages, or of the model's children (split experts first, over edp)."""
    if stages is not None:
        units = apply_fsdp([module for _, module in stages], dims.dp_cp_mesh, config.ddp, device, compute_dtype)
        return ParallelModel(model, dims, fsdp_modules=units, checkpoint_rules=[ShardedStagesRule()])
    if any(True for _ in model.parameters(recurse=False)):
        raise TypeError(
            f"{type(model).__name__} holds parameters itself; FSDP shards its submodules, "
            "so keep parameters in submodules (e.g. `self.module`)"
        )
    experts = []
    if dims.expert_mesh is not None:
        reduce_dtype = torch.float32 if config.ddp.grad_reduce_in_fp32 else compute_dtype
        experts = shard_experts_fsdp(
            moe_layers,
            dims.expert_mesh,
            dims.dp_cp_mesh.size(),
            device,
            MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype),
            reshard_after_forward=config.ddp.data_parallel_sharding_strategy == "optim_grads_params",
        )
    roots = [child for child in model.children() if any(True for _ in child.parameters())]
    units = apply_fsdp(roots, dims.dp_cp_mesh, config.ddp, device, compute_dtype)
    return ParallelModel(model, dims, fsdp_modules=experts + units)


def _replicate(
    model: nn.Module,
    config: ParallelismConfig,
    dims: ParallelDims,
    device: torch.device,
    compute_dtype: torch.dtype | None,
    num_microbatches: int,
    stages: Stages | None,
    ddp_kwargs: dict[str, Any],
) -> ParallelModel:
    """Whole parameters on every dp x cp rank: DDP where it can serve, else the reducer the layout needs."""
    materialize(model, device)
    model.to(device)
    group = dims.dp_cp_mesh.get_group()
    replicas = dims.dp_cp_mesh.size()
    if dims.expert_mesh is not None:
        reducer = ExpertParallelGradReducer(model, group, dims.expert_replica_mesh.get_group())
        return ParallelModel(model, dims, grad_reducer=reducer)
    if stages is not None:
        reducer = None
        if replicas > 1:  # each stage's bucket while the other stages compute, or all at once after the schedule
            overlap = config.ddp.overlap_grad_reduce
            reducer = (
                StageGradientReducer(stages, group, num_microbatches)
                if overlap
                else GradientAllReducer(model, group, False)
            )
        return ParallelModel(model, dims, grad_reducer=reducer)
    if config.tensor_model_parallel_size > 1:  # DDP cannot reduce DTensor gradients
        reducer = GradientAllReducer(model, group, config.ddp.overlap_grad_reduce) if replicas > 1 else None
        return ParallelModel(model, dims, grad_reducer=reducer)
    grad_dtype = next(model.parameters()).dtype
    reduce_dtype = None if config.ddp.grad_reduce_in_fp32 or compute_dtype is None else compute_dtype
    ddp = apply_ddp(model, dims.dp_cp_mesh, config.ddp, grad_dtype=grad_dtype, reduce_dtype=reduce_dtype, **ddp_kwargs)
    return ParallelModel(ddp, dims)

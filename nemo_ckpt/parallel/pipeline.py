"""Pipeline parallelism on `torch.distributed.pipelining`: options, stages, schedules and the tied-weight group.

A LightningModule takes part by defining `split_pipeline(pipeline_mesh, virtual_size)`, which keeps only
its stages' modules and returns them as (stage index, module) (the GPT's split is in
`nemo_ckpt.models.gpt.pipeline`). `PipelineRunner` wraps those modules in `PipelineStage`s over the `pp`
dimension of the mesh and runs one schedule step per optimizer step: the data loader's micro-batches of a step
(`global_batch_size / (micro_batch_size x dp)` of them) come as one batch (`MicroBatchGroups`), which GPipe,
1F1B or interleaved 1F1B splits again and runs. The loss lives on the last stage; the step's mean loss is broadcast
to every stage for logging.
"""

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from nemo_ckpt._compat import unbatched_1f1b_schedule
from nemo_ckpt.dist_checkpointing.dtensor import local_tensor
from nemo_ckpt.parallel.checkpoint_rule import CheckpointRule
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
PIPELINE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@runtime_checkable
class PipelineSplittable(Protocol):
    """A LightningModule that splits into pipeline stages.

    `split_pipeline` keeps only this pipeline rank's stages and returns them as (global stage index, module);
    `pipeline_inputs(batch)` gives the first stage's input and the loss target; `pipeline_loss(output, target)`
    is a micro-batch's loss on the last stage; `pipeline_tied_weight()` names the parameter the first and last
    stage share (tied embeddings), or None.
    """

    def split_pipeline(self, pipeline_mesh: DeviceMesh, virtual_size: int) -> list[tuple[int, nn.Module]]: ...

    def pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def pipeline_tied_weight(self) -> str | None: ...


@dataclass(frozen=True)
class PipelineConfig:
    """Megatron/NeMo's pipeline options, validated when built.

    `virtual_pipeline_model_parallel_size` (V): model chunks per rank, run by the interleaved 1F1B schedule.
    `microbatch_group_size_per_vp_stage`: micro-batches run on one virtual stage before moving to the next
    (Megatron's default and the only value torch's interleaved schedule runs: the pipeline size).
    `pipeline_dtype`: the dtype of activations sent between stages (None: as computed).
    `schedule`: `gpipe`, `1f1b` or `interleaved_1f1b` (default: `interleaved_1f1b` with V > 1, else `1f1b`).
    `overlap_p2p_comm` (interleaved schedule only; its default): each stage's receives are posted as early as the
    schedule allows and waited on just before use, overlapping sends and receives with the computation in
    between; off, each receive is posted right before the computation that needs it.
    `batch_p2p_comm` (1f1b only; its default): a steady-state step's send and receive go out together in one
    `batch_isend_irecv`; off, each is its own `isend`/`irecv`. Megatron's rule: not both on.
    """

    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    microbatch_group_size_per_vp_stage: int | None = None
    pipeline_dtype: torch.dtype | str | None = None
    schedule: str | None = None
    overlap_p2p_comm: bool | None = None
    batch_p2p_comm: bool | None = None

    def __post_init__(self) -> None:
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_model_parallel_size={pp}: use 1 or more")
        if vpp is not None and (vpp < 1 or pp == 1):
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 (got {pp}) and "
                "a value of 1 or more; set pipeline_model_parallel_size or leave the virtual size None"
            )
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {self.schedule!r}: choose one of {sorted(SCHEDULES)}")
        if self.schedule is not None and pp == 1:
            raise ValueError(f"pipeline schedule {self.schedule!r} needs pipeline_model_parallel_size > 1")
        interleaved = self.schedule_name == "interleaved_1f1b"
        if interleaved != (self.virtual_size > 1):
            raise ValueError(
                f"pipeline schedule {self.schedule!r} with virtual_pipeline_model_parallel_size={vpp}: the "
                "interleaved_1f1b schedule runs virtual stages (V > 1), gpipe and 1f1b run one stage per rank"
            )
        group = self.microbatch_group_size_per_vp_stage
        if group is not None and (not interleaved or group != pp):
            raise ValueError(
                f"microbatch_group_size_per_vp_stage={group}: only the interleaved schedule (V > 1) groups "
                f"micro-batches, and torch's runs groups of pipeline_model_parallel_size={pp}; set it to {pp} or None"
            )
        self._check_p2p_options()
        if isinstance(self.pipeline_dtype, str) and self.pipeline_dtype not in PIPELINE_DTYPES:
            raise ValueError(
                f"pipeline_dtype={self.pipeline_dtype!r}: use a torch dtype or one of {sorted(PIPELINE_DTYPES)}"
            )

    def _check_p2p_options(self) -> None:
        overlap, batch, name = self.overlap_p2p_comm, self.batch_p2p_comm, self.schedule_name
        given = {
            key: value for key, value in (("overlap_p2p_comm", overlap), ("batch_p2p_comm", batch)) if value is not None
        }
        if given and not self.enabled:
            raise ValueError(
                f"{', '.join(f'{key}={value}' for key, value in given.items())}: pipeline send/receive options "
                "need pipeline_model_parallel_size > 1; leave them unset"
            )
        if overlap and batch:
            raise ValueError(
                "overlap_p2p_comm=True and batch_p2p_comm=True: overlapped receives are posted one by one, ahead "
                "of their use, so they cannot be batched (Megatron's rule); set batch_p2p_comm=False"
            )
        if overlap and name != "interleaved_1f1b":
            raise ValueError(
                f"overlap_p2p_comm=True takes effect with the interleaved schedule only (the {name!r} schedule "
                "runs here); set virtual_pipeline_model_parallel_size > 1 or overlap_p2p_comm=False"
            )
        if batch and name != "1f1b":
            reason = (
                "gpipe never sends and receives in the same step"
                if name == "gpipe"
                else "torch's interleaved runtime posts each send and receive on its own"
            )
            raise ValueError(
                f"batch_p2p_comm=True takes effect with the 1f1b schedule only ({reason}); set batch_p2p_comm=False "
                "or leave it unset"
            )

    @property
    def overlaps_p2p(self) -> bool:
        """Whether receives are posted ahead of their use (the interleaved schedule's default)."""
        default = self.schedule_name == "interleaved_1f1b"
        return default if self.overlap_p2p_comm is None else self.overlap_p2p_comm

    @property
    def batches_p2p(self) -> bool:
        """Whether a step's send and receive go out in one `batch_isend_irecv` (the 1f1b schedule's default)."""
        default = self.schedule_name == "1f1b"
        return default if self.batch_p2p_comm is None else self.batch_p2p_comm

    @property
    def enabled(self) -> bool:
        return self.pipeline_model_parallel_size > 1

    @property
    def virtual_size(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def schedule_name(self) -> str:
        if self.schedule is not None:
            return self.schedule
        return "interleaved_1f1b" if self.virtual_size > 1 else "1f1b"

    @property
    def activation_dtype(self) -> torch.dtype | None:
        dtype = self.pipeline_dtype
        return PIPELINE_DTYPES[dtype] if isinstance(dtype, str) else dtype

    def validate_microbatches(self, num_microbatches: int) -> None:
        """Raise, naming the numbers, if the schedule cannot run `num_microbatches` per step."""
        pp = self.pipeline_model_parallel_size
        name = self.schedule_name
        fix = "change global_batch_size, micro_batch_size or the data-parallel size"
        count = f"global_batch_size / (micro_batch_size x data-parallel size) = {num_microbatches} micro-batches"
        if name == "1f1b" and num_microbatches < pp:
            raise ValueError(
                f"The 1f1b pipeline schedule needs at least pipeline_model_parallel_size={pp} {count}; {fix}"
            )
        if name == "interleaved_1f1b" and num_microbatches % pp:
            raise ValueError(
                f"The interleaved pipeline schedule (virtual_pipeline_model_parallel_size={self.virtual_size}) needs "
                f"{count} to be a multiple of microbatch_group_size_per_vp_stage = pipeline_model_parallel_size={pp} "
                f"(Megatron's rule); {fix}"
            )


def cast_output(dtype: torch.dtype) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    """A forward hook casting a stage's output (the activations sent to the next stage) to `dtype`."""

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


def cast_inputs(dtype: torch.dtype) -> Callable[[nn.Module, tuple], tuple]:
    """A forward pre-hook casting a stage's floating-point inputs (the activations received) to `dtype`, so that
    `pipeline_dtype` changes only what is sent between stages."""

    def hook(module: nn.Module, inputs: tuple) -> tuple:
        return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)

    return hook


def build_schedule(
    config: PipelineConfig,
    stages: list[PipelineStage],
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The configured schedule over this rank's stages, with its send/receive options."""
    name = config.schedule_name
    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(
            stages, num_microbatches, loss_fn=loss_fn, scale_grads=True, defer_pp_recv=not config.overlaps_p2p
        )
    if name == "1f1b" and not config.batches_p2p:
        return unbatched_1f1b_schedule(stages[0], num_microbatches, loss_fn)
    return SCHEDULES[name](stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=True)


class MicroBatchGroups:
    """A data loader's micro-batches in groups of `size`, each concatenated into one batch: what one pipeline
    step runs (an incomplete last group is dropped)."""

    def __init__(self, dataloader: Iterable[dict[str, torch.Tensor]], size: int) -> None:
        self.dataloader, self.size = dataloader, size

    def __len__(self) -> int:
        return len(self.dataloader) // self.size

    def state_dict(self) -> dict[str, Any]:
        """The wrapped loader's resumable state (Lightning's `_Stateful`), if it has one."""
        return self.dataloader.state_dict() if hasattr(self.dataloader, "state_dict") else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict and hasattr(self.dataloader, "load_state_dict"):
            self.dataloader.load_state_dict(state_dict)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        group = []
        for batch in self.dataloader:
            group.append(batch)
            if len(group) == self.size:
                yield {key: torch.cat([micro_batch[key] for micro_batch in group]) for key in group[0]}
                group = []


class PipelineRunner:
    """This rank's pipeline stages and their schedule, run once per optimizer step on a step's micro-batches.

    `stage_modules`: (global stage index, module) from `split_pipeline`, wrapped (FSDP2) or not. `loss_fn(output,
    target)`: a micro-batch's mean loss (gradients are scaled by 1 / micro-batches, so the step's gradient is
    that of the mean loss).
    """

    def __init__(
        self,
        config: PipelineConfig,
        stage_modules: Sequence[tuple[int, nn.Module]],
        pipeline_mesh: DeviceMesh,
        device: torch.device,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        config.validate_microbatches(num_microbatches)
        self.config = config
        self.num_microbatches = num_microbatches
        self.group = pipeline_mesh.get_group()
        num_stages = config.pipeline_model_parallel_size * config.virtual_size
        self.stages = [
            PipelineStage(module, index, num_stages, device, group=self.group) for index, module in stage_modules
        ]
        dtype = config.activation_dtype
        if dtype is not None:
            for stage in self.stages:
                if not stage.is_last:
                    stage.submod.register_forward_hook(cast_output(dtype))
                if not stage.is_first:  # back to the parameters' dtype, before FSDP2's own input cast
                    parameter = next(stage.submod.parameters())
                    stage.submod.register_forward_pre_hook(cast_inputs(parameter.dtype), prepend=True)
        self.schedule = build_schedule(config, self.stages, num_microbatches, loss_fn)
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self.last_stage_rank = dist.get_global_rank(self.group, self.group.size() - 1)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor:
        """Run the schedule on a step's batch (split into the micro-batches; forward and backward if `train`);
        return their mean loss, the same on every stage."""
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        losses: list[torch.Tensor] = []
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses, return_outputs=False)
        loss = torch.stack([loss.detach().float() for loss in losses]).mean() if self.has_last else None
        if loss is None:
            loss = torch.zeros((), device=inputs.device)
        dist.broadcast(loss, src=self.last_stage_rank, group=self.group)
        return loss


class StageGradientReducer:
    """Data parallelism of unsharded pipeline stages, overlapped per virtual stage (Megatron's
    `overlap_grad_reduce` under pipeline parallelism): each stage's gradients form one bucket, all-reduced over
    the data-parallel `group` asynchronously as soon as backward has accumulated the stage's last micro-batch,
    while this rank's other stages still compute. `finish()` waits and writes the averages back.

    A bucket is copied when launched, before the schedule scales the gradients by 1 / `num_microbatches`, so it
    is divided by data-parallel size x micro-batches. A stage whose bucket did not start (a parameter got no
    gradient in some micro-batch) is reduced in `finish()`.
    """

    def __init__(
        self, stages: Sequence[tuple[int, nn.Module]], group: dist.ProcessGroup, num_microbatches: int
    ) -> None:
        self.group, self.num_microbatches = group, num_microbatches
        self.params = {
            index: [param for param in module.parameters() if param.requires_grad] for index, module in stages
        }
        self.counts = dict.fromkeys(self.params, 0)
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work]] = []
        self.launched: list[int] = []
        for index, params in self.params.items():
            for param in params:
                param.register_post_accumulate_grad_hook(lambda _, index=index: self._count(index))

    def _count(self, index: int) -> None:
        self.counts[index] += 1
        if self.counts[index] == len(self.params[index]) * self.num_microbatches:
            grads = [local_tensor(param.grad) for param in self.params[index]]
            bucket = torch.cat([grad.flatten() for grad in grads])
            self.pending.append((grads, bucket, dist.all_reduce(bucket, group=self.group, async_op=True)))
            self.launched.append(index)

    @torch.no_grad()
    def finish(self) -> list[int]:
        """Complete this step's averaging of every stage's gradients; return the stages whose buckets started
        during backward, in launch order."""
        for grads, bucket, work in self.pending:
            work.wait()
            _copy_back(grads, bucket.div_(self.group.size() * self.num_microbatches))
        for index in self.params.keys() - set(self.launched):
            grads = [local_tensor(param.grad) for param in self.params[index] if param.grad is not None]
            if grads:
                bucket = torch.cat([grad.flatten() for grad in grads])
                dist.all_reduce(bucket, group=self.group)
                _copy_back(grads, bucket.div_(self.group.size()))  # already scaled by the schedule
        launched, self.launched, self.pending = self.launched, [], []
        self.counts = dict.fromkeys(self.params, 0)
        return launched


def _copy_back(grads: list[torch.Tensor], bucket: torch.Tensor) -> None:
    for grad, reduced in zip(grads, bucket.split([grad.numel() for grad in grads])):
        grad.copy_(reduced.view_as(grad))


def check_pipeline_options(config: PipelineConfig, ddp_config: DistributedDataParallelConfig) -> None:
    """Configuration-time errors for pipeline parallelism combined with what it does not support yet."""
    if not config.enabled:
        return
    pp = config.pipeline_model_parallel_size
    if ddp_config.data_parallel_sharding_strategy == "optim":
        raise ValueError(
            f"MegatronStrategy(pipeline_model_parallel_size={pp}) with data_parallel_sharding_strategy='optim' "
            "(ZeRO-1) is not supported yet; use 'no_shard', 'optim_grads' or 'optim_grads_params'"
        )


def tied_weight(model: nn.Module, mesh: DeviceMesh, pipeline_dim: str) -> "TiedWeight | None":
    """The first and last stage's shared weight of `model` (`pipeline_tied_weight()`) on this rank, with its
    embedding group; None on middle stages or without one. A collective: call it on every rank."""
    name = model.pipeline_tied_weight()
    if name is None:
        return None
    group, is_first = embedding_group(mesh, pipeline_dim)
    return None if group is None else TiedWeight(model, name, group, is_first)


def embedding_group(mesh: DeviceMesh, pipeline_dim: str) -> tuple[dist.ProcessGroup | None, bool]:
    """The embedding group of Megatron: this rank with its peer (same other coordinates) on the other end of the
    pipeline. Returns (group, whether this rank is the first stage); (None, False) on middle stages.

    Every rank creates every group (a collective), so call it on all ranks.
    """
    pp_index = mesh.mesh_dim_names.index(pipeline_dim)
    ranks = mesh.mesh.movedim(pp_index, 0)
    first, last = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
    mine, is_first = None, False
    for first_rank, last_rank in zip(first, last):
        group = dist.new_group([first_rank, last_rank])
        if dist.get_rank() in (first_rank, last_rank):
            mine, is_first = group, dist.get_rank() == first_rank
    return mine, is_first


class TiedWeight:
    """A weight used on the first and the last pipeline stage (the embedding and the output layer): the copies
    start equal (broadcast from the first stage) and their gradients are summed over the embedding group."""

    def __init__(self, model: nn.Module, name: str, group: dist.ProcessGroup, is_first: bool) -> None:
        self.model, self.name, self.group = model, name, group
        self.first_rank = dist.get_global_rank(group, 0)
        self.is_first = is_first

    @property
    def param(self) -> nn.Parameter:
        """The parameter now (FSDP2 and tensor parallelism replace parameter objects)."""
        return self.model.get_parameter(self.name)

    @torch.no_grad()
    def broadcast(self) -> None:
        dist.broadcast(local_tensor(self.param.data), src=self.first_rank, group=self.group)

    @torch.no_grad()
    def all_reduce_grad(self) -> None:
        grad = self.param.grad
        if grad is None:
            grad = self.param.grad = torch.zeros_like(self.param)
        dist.all_reduce(local_tensor(grad), group=self.group)


@torch.no_grad()
def clip_grad_norm_pipeline(
    parameters: Iterable[nn.Parameter], max_norm: float, group: dist.ProcessGroup, shared_copy: nn.Parameter | None
) -> torch.Tensor:
    """Clip to a global L2 norm of `max_norm` when each pipeline stage holds different parameters: the stages'
    squared norms are summed over the pipeline `group` (`shared_copy`, the last stage's copy of a tied weight,
    counted once, on the first stage). Returns the norm before clipping, the same on every rank."""
    params = [param for param in parameters if param.grad is not None]
    counted = [param.grad for param in params if param is not shared_copy]
    norm = torch.nn.utils.get_total_norm(counted, foreach=True) if counted else torch.zeros(())
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    square = norm.float().square()
    dist.all_reduce(square, group=group)
    total = square.sqrt()
    coefficient = min(1.0, max_norm / (float(total) + 1e-6))
    if coefficient < 1.0:
        for param in params:
            local_tensor(param.grad).mul_(coefficient)
    return total


def _model_order(stage_names: list[str]) -> dict[str, float]:
    """Sort keys putting one stage's parameter names in model order: layers by global index, names before the
    stage's first layer (the embedding) before every layer, names after its last (norm, output) after all."""
    keys, position = {}, float("-inf")
    for name in stage_names:
        match = re.search(r"(^|\.)layers\.(\d+)\.", name)
        if match:
            position = float(match.group(2))
        keys[name] = position if match or position == float("-inf") else float("inf")
    return keys


def merge_pipeline_optimizer_state(optim_state: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """Add the other stages' parameter names and scalar state (Adam's `step`) to this stage's
    `named_optimizer_state`, so the common part of a checkpoint (written by one rank) describes every stage.

    Parameter lists are in model order (layers by global index), as one process lists them.
    """
    scalars = {
        name: {key: value for key, value in state.items() if not isinstance(value, torch.Tensor) or value.dim() == 0}
        for name, state in optim_state["state"].items()
    }
    group_params = [group_state["params"] for group_state in optim_state["param_groups"]]
    gathered: list[Any] = [None] * group.size()
    dist.all_gather_object(gathered, (scalars, group_params), group=group)
    state = dict(optim_state["state"])
    for stage_scalars, _ in gathered:
        for name, entries in stage_scalars.items():
            state.setdefault(name, entries)
    param_groups = []
    for index, group_state in enumerate(optim_state["param_groups"]):
        keys: dict[str, float] = {}
        for _, stage_params in gathered:
            for name, key in _model_order(stage_params[index]).items():
                keys.setdefault(name, key)
        names = sorted(keys, key=keys.__getitem__)  # stable: ties keep the gathered order
        param_groups.append({**group_state, "params": names})
    return {"state": state, "param_groups": param_groups}


class PipelineCheckpointRule(CheckpointRule):
    """Pipeline stages in a checkpoint: the common part lists every stage's parameters and scalar optimizer state;
    the tied weight is written by the first stage (the last stage's copy is a replica)."""

    def __init__(self, tied: TiedWeight | None, pipeline_group: dist.ProcessGroup, replica_rank: int) -> None:
        self.tied = tied
        self.pipeline_group = pipeline_group
        self.replica_rank = replica_rank

    def replica_ids(self, state_dict: dict[str, Any]) -> dict[str, int]:
        if self.tied is None or self.tied.is_first:
            return {}
        return {self.tied.name: 1 + self.replica_rank}

    def complete_optimizer_state(
        self, optimizer: Optimizer, state: dict[str, Any], names: dict[nn.Parameter, str]
    ) -> dict[str, Any]:
        return merge_pipeline_optimizer_state(state, self.pipeline_group)

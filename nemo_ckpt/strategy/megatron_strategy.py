"""`MegatronStrategy`: NeMo's Lightning strategy on plain PyTorch, saving through `dist_checkpointing`.

Data parallelism follows `DistributedDataParallelConfig.data_parallel_sharding_strategy`: DDP (`no_shard`),
DDP with a ZeRO-1 sharded optimizer (`optim`) or FSDP2 (`optim_grads`, `optim_grads_params`), over the `dp`
dimension of a device mesh (gloo on CPU, NCCL on GPU). Checkpoints use layout-independent keys, so a run
resumes under any other sharding strategy and world size.
"""

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer

from nemo_ckpt._compat import lightning_ddp_kwargs, optimizers_to_device
from nemo_ckpt.options import strict_options
from nemo_ckpt.parallel.context_parallel import apply_context_parallel, check_context_parallel_options, split_batch
from nemo_ckpt.parallel.ddp import apply_ddp
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.expert_parallel import (
    ExpertParallelGradReducer,
    apply_expert_parallel,
    check_expert_parallel_options,
    complete_expert_param_groups,
    expert_replica_ids,
    shard_expert_scalar_state,
    shard_experts_fsdp,
)
from nemo_ckpt.parallel.fsdp import apply_fsdp
from nemo_ckpt.parallel.gradients import GradientAllReducer, check_grads_finite
from nemo_ckpt.parallel.mesh import (
    CONTEXT_PARALLEL_DIM,
    DATA_PARALLEL_DIM,
    EXPERT_DATA_PARALLEL_DIM,
    PIPELINE_PARALLEL_DIM,
    TENSOR_PARALLEL_DIM,
    ParallelDims,
)
from nemo_ckpt.parallel.meta_init import default_generator, has_meta_tensors, materialize, record_init_rng_states
from nemo_ckpt.parallel.pipeline import (
    MicroBatchGroups,
    PipelineConfig,
    PipelineRunner,
    PipelineSplittable,
    StageGradientReducer,
    TiedWeight,
    check_pipeline_options,
    merge_pipeline_optimizer_state,
    tied_weight,
)
from nemo_ckpt.parallel.tensor_parallel import apply_tensor_parallel
from nemo_ckpt.parallel.zero import ZeroOneSharding
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions, require_optimizer_state
from nemo_ckpt.strategy.state_dict import (
    init_optimizer_state,
    load_module_state,
    load_named_optimizer_state,
    model_sharded_state_dict,
    named_optimizer_state,
    optimizer_sharded_state_dict,
    saves_gpu_buffers,
)


def ddp_config_from(ddp: str | DistributedDataParallelConfig) -> DistributedDataParallelConfig:
    """NeMo's `ddp` argument: a config, `"megatron"` (Megatron's DDP, checking gradients for NaN) or
    `"pytorch"` (plain torch DDP)."""
    if isinstance(ddp, DistributedDataParallelConfig):
        return ddp
    if ddp == "megatron":
        return DistributedDataParallelConfig(check_for_nan_in_grad=True)
    if ddp == "pytorch":
        return DistributedDataParallelConfig()
    raise ValueError(
        f"MegatronStrategy(ddp={ddp!r}): use 'megatron', 'pytorch' or a DistributedDataParallelConfig, e.g. "
        "run.Config(DistributedDataParallelConfig, data_parallel_sharding_strategy='optim_grads_params')"
    )


# NeMo MegatronStrategy options this strategy does not implement, with what they mean in NeMo.
NEMO_UNSUPPORTED = {
    "pipeline_model_parallel_comm_backend": "the backend of pipeline send/recv; the process group's is used",
    "encoder_tensor_model_parallel_size": "tensor parallelism of an encoder (encoder-decoder models)",
    "encoder_pipeline_model_parallel_size": "pipeline stages of an encoder (encoder-decoder models)",
    "moe_extended_tp": "Megatron's deprecated extended tensor parallelism of experts; set "
    "expert_tensor_parallel_size (experts sharded over tp, or 1: whole on each tp rank)",
    "num_distributed_optimizer_instances": "replicas of Megatron's distributed optimizer; ZeRO-1 here is "
    "data_parallel_sharding_strategy='optim'",
    "data_sampler": "NeMo's MegatronDataSampler; the data module's sampler is used here",
    "fsdp": "'megatron' or 'pytorch' FSDP; set ddp.data_parallel_sharding_strategy='optim_grads_params' (FSDP2)",
    "lazy_init": "build the model without allocating weights; use init_model_with_meta_device=True",
    "use_te_rng_tracker": "Transformer Engine's CUDA RNG tracker; no Transformer Engine here",
    "use_sharp": "SHARP in-network reductions for NCCL",
    "ckpt_save_optimizer": "whether checkpoints hold the optimizer state; use ModelCheckpoint(save_weights_only=...)",
    "ckpt_load_on_device": "load checkpoint tensors straight to the GPU; use ckpt_load_directly_on_device",
    "ckpt_load_main_params": "load fp32 main parameters of a mixed-precision optimizer as the model weights",
    "ckpt_optim_fully_reshardable": "Megatron's fully reshardable distributed-optimizer format; optimizer state is "
    "always reshardable here",
    "setup_optimizers": "skip building optimizers at setup",
    "init_model_parallel": "skip Megatron's model-parallel initialization",
    "replace_progress_bar": "NeMo's MegatronProgressBar",
    "progress_interval": "the MegatronProgressBar refresh interval",
    "restore_config": "NeMo's RestoreConfig (load weights from a pretrained checkpoint); use AutoResume",
    "megatron_log_level": "Megatron-Core's log level",
    "nccl_communicator_config_path": "NCCL communicator settings from a YAML file",
    "use_tp_pp_dp_mapping": "rank order tp-pp-dp instead of tp-dp-pp",
    "account_for_embedding_in_pipeline_split": "count the embedding as a layer; see num_layers_in_first_pipeline_stage",
    "account_for_loss_in_pipeline_split": "count the loss as a pipeline layer; use num_layers_in_last_pipeline_stage",
    "checkpoint_io": "a custom CheckpointIO; checkpoints go through DistCheckpointIO, set by the ckpt_* options",
    "ddp_comm_state": "a DDP communication hook's state (Lightning); gradients are reduced as `ddp` configures",
    "ddp_comm_hook": "a DDP communication hook (Lightning); gradients are reduced as `ddp` configures",
    "ddp_comm_wrapper": "a DDP communication hook wrapper (Lightning); gradients are reduced as `ddp` configures",
    "model_averaging_period": "Lightning's post-local SGD model averaging",
    "bucket_cap_mb": "DDP's bucket size in MB; set ddp.bucket_size (elements) instead",
}
# torch DistributedDataParallel's options, passed through as in Lightning's DDPStrategy.
DDP_DEFAULTS = {
    "find_unused_parameters": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
    "broadcast_buffers": True,
}


@strict_options(NEMO_UNSUPPORTED)
class MegatronStrategy(DDPStrategy):
    """Megatron-style parallel training with sharded, reshardable checkpoints, on a (pp, dp, cp, tp) mesh
    (`nemo_ckpt/parallel/mesh.py`; the data-parallel size is what the world size leaves after pp x cp x tp).

    `ddp`: a `DistributedDataParallelConfig` (DDP, ZeRO-1 or FSDP2 over dp x cp), or `"megatron"` / `"pytorch"`.
    `tensor_model_parallel_size`, `sequence_parallel`: tensor (and sequence) parallelism on DTensor over `tp`, with
    the model's own plan (e.g. nemo_ckpt/models/gpt/parallelize.py), applied before data parallelism.
    `pipeline_model_parallel_size`, `virtual_pipeline_model_parallel_size`, `microbatch_group_size_per_vp_stage`,
    `pipeline_dtype`, `pipeline_schedule`: pipeline parallelism over `pp` (`nemo_ckpt/parallel/pipeline.py`).
    `context_parallel_size`, `cp_comm_type`: sequences split over `cp`, ring attention
    (`nemo_ckpt/parallel/context_parallel.py`).
    `expert_model_parallel_size`: MoE experts split over that many ranks of dp x cp
    (`nemo_ckpt/parallel/expert_parallel.py`); `expert_tensor_parallel_size`: with tensor parallelism, each expert
    sharded over tp (None, the default, or `tensor_model_parallel_size`) or whole on every tp rank (1).
    `init_model_with_meta_device`: build the model on `meta` in `configure_model`, then materialize it module
    by module with `reset_parameters` while sharding, so no rank ever holds the whole model.
    bf16 mixed precision comes from the Trainer (`precision="bf16-mixed"`): fp32 parameters (the master
    weights), bf16 compute, gradients reduced in fp32 if `ddp.grad_reduce_in_fp32`, else in bf16.
    `ckpt_*`: `DistCheckpointOptions`, but `ckpt_load_optimizer`: False resumes a checkpoint's weights (also one
    saved without optimizer state) at its step, with a fresh optimizer and the run's LR schedule at that step.
    `find_unused_parameters`, `gradient_as_bucket_view`, `static_graph`,
    `broadcast_buffers`: torch DDP's, used with `ddp` `no_shard` or `optim` without tensor parallelism.
    `parallel_devices`, `cluster_environment`, `process_group_backend`, `timeout`: Lightning's DDPStrategy's.
    Any other argument is an error: a misspelt one names the closest option, a NeMo option not implemented here
    says what it means in NeMo (`NEMO_UNSUPPORTED`).
    With `ckpt_async_overlap_staging`, an async save's copies of GPU state into pinned host memory overlap the next
    forward and backward: the optimizer's update (and any load) waits for them on the GPU; where the model's state
    dict holds GPU buffers, which forward may change, the save waits for them instead. Code that changes parameters
    or optimizer state in place elsewhere (e.g. swapping in averaged weights for validation) calls
    `trainer.strategy.checkpoint_io.order_after_staging()` first.
    """

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        ddp: str | DistributedDataParallelConfig = "megatron",
        init_model_with_meta_device: bool = False,
        save_ckpt_format: str = "torch_dist",
        ckpt_async_save: bool = False,
        ckpt_parallel_save: bool = True,
        ckpt_parallel_save_within_dp: bool = False,
        ckpt_parallel_load: bool = False,
        ckpt_torch_dist_multiproc: int | None = None,
        ckpt_assume_constant_structure: bool = False,
        ckpt_parallel_save_optim: bool = True,
        ckpt_load_directly_on_device: bool = False,
        ckpt_load_strictness: str | None = None,
        ckpt_async_save_timeout: float | None = None,
        ckpt_async_save_failure: str = "raise",
        ckpt_verify_on_load: bool = True,
        ckpt_async_writer_process: bool = False,
        ckpt_async_overlap_staging: bool = False,
        ckpt_load_optimizer: bool = True,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        microbatch_group_size_per_vp_stage: int | None = None,
        pipeline_dtype: torch.dtype | str | None = None,
        pipeline_schedule: str | None = None,
        context_parallel_size: int = 1,
        cp_comm_type: str | None = None,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        broadcast_buffers: bool = True,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
    ) -> None:
        ddp_options = {
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "broadcast_buffers": broadcast_buffers,
        }
        # Only the changed ones reach torch DDP: torch 2.13 warns whenever `broadcast_buffers` is passed (deprecated
        # for `forward_sync_buffers`, whose False, unlike `broadcast_buffers=False`, still syncs buffers at init).
        ddp_kwargs = {name: value for name, value in ddp_options.items() if value != DDP_DEFAULTS[name]}
        checkpoint_io = DistCheckpointIO(
            DistCheckpointOptions(
                save_ckpt_format=save_ckpt_format,
                ckpt_async_save=ckpt_async_save,
                ckpt_parallel_save=ckpt_parallel_save,
                ckpt_parallel_save_within_dp=ckpt_parallel_save_within_dp,
                ckpt_parallel_load=ckpt_parallel_load,
                ckpt_torch_dist_multiproc=ckpt_torch_dist_multiproc,
                ckpt_assume_constant_structure=ckpt_assume_constant_structure,
                ckpt_parallel_save_optim=ckpt_parallel_save_optim,
                ckpt_load_directly_on_device=ckpt_load_directly_on_device,
                ckpt_load_strictness=ckpt_load_strictness,
                ckpt_async_save_timeout=ckpt_async_save_timeout,
                ckpt_async_save_failure=ckpt_async_save_failure,
                ckpt_verify_on_load=ckpt_verify_on_load,
                ckpt_async_writer_process=ckpt_async_writer_process,
                ckpt_async_overlap_staging=ckpt_async_overlap_staging,
            )
        )
        super().__init__(
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **ddp_kwargs,
        )
        self.ddp_config = ddp_config_from(ddp)
        if ddp_kwargs and (self.ddp_config.shards_parameters or tensor_model_parallel_size > 1):
            name, value = next(iter(ddp_kwargs.items()))
            raise ValueError(
                f"MegatronStrategy({name}={value!r}) is an option of torch DDP, which is not "
                "used with FSDP2 (ddp.data_parallel_sharding_strategy='optim_grads[_params]') or tensor parallelism; "
                "remove it"
            )
        if tensor_model_parallel_size < 1:
            raise ValueError(
                f"MegatronStrategy(tensor_model_parallel_size={tensor_model_parallel_size}): use 1 or more"
            )
        if sequence_parallel and tensor_model_parallel_size == 1:
            raise ValueError(
                "MegatronStrategy(sequence_parallel=True) shards activations over tensor-parallel ranks; "
                "set tensor_model_parallel_size > 1 or sequence_parallel=False"
            )
        if tensor_model_parallel_size > 1 and self.ddp_config.data_parallel_sharding_strategy == "optim":
            raise ValueError(
                "MegatronStrategy(tensor_model_parallel_size > 1) does not support "
                "data_parallel_sharding_strategy='optim' (ZeRO-1); use 'no_shard', 'optim_grads' or "
                "'optim_grads_params'"
            )
        expert_tensor_parallel_size = check_expert_parallel_options(
            expert_model_parallel_size,
            expert_tensor_parallel_size,
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            self.ddp_config.data_parallel_sharding_strategy,
        )
        self.pipeline_config = PipelineConfig(
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage,
            pipeline_dtype,
            pipeline_schedule,
        )
        check_pipeline_options(self.pipeline_config, self.ddp_config)
        self.cp_comm_type = check_context_parallel_options(context_parallel_size, cp_comm_type)
        self.context_parallel_size = context_parallel_size
        self._pipeline: PipelineRunner | None = None
        self._pipeline_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tied_weight: TiedWeight | None = None
        self.expert_model_parallel_size = expert_model_parallel_size
        self.expert_tensor_parallel_size = expert_tensor_parallel_size
        self._expert_mesh: DeviceMesh | None = None
        self._expert_grad_reducer: ExpertParallelGradReducer | None = None
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.sequence_parallel = sequence_parallel
        self.init_model_with_meta_device = init_model_with_meta_device
        self.ckpt_load_optimizer = ckpt_load_optimizer
        self._parallel_dims: ParallelDims | None = None
        self._device_mesh: DeviceMesh | None = None
        self._data_context_parallel_mesh: DeviceMesh | None = None
        self._fsdp_modules: list[FSDPModule] = []
        self._tensor_parallel_grad_reducer: GradientAllReducer | None = None
        self._zero: dict[Optimizer, ZeroOneSharding] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any) -> None:
        self.checkpoint_io.maybe_finalize(blocking=False)  # complete async saves that have been written
        super().on_train_batch_start(batch, batch_idx, *args)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.ckpt_load_optimizer

    @property
    def parallel_dims(self) -> ParallelDims:
        """The size of each parallel dimension, known when the process group starts."""
        if self._parallel_dims is None:
            raise RuntimeError("MegatronStrategy.parallel_dims is set in setup_environment(); use it after that")
        return self._parallel_dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The (pp, dp, cp, tp) device mesh (see `parallel/mesh.py`), built when the process group starts."""
        if self._device_mesh is None:
            raise RuntimeError("MegatronStrategy.device_mesh is built in setup_environment(); use it after that")
        return self._device_mesh

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        """Ranks that read different batches (the data samplers shard over it)."""
        return self.device_mesh[DATA_PARALLEL_DIM]

    @property
    def data_context_parallel_mesh(self) -> DeviceMesh:
        """Ranks holding the same weights (dp x cp): gradients are reduced and FSDP/ZeRO-1 shard over it."""
        if self._data_context_parallel_mesh is None:
            raise RuntimeError("MegatronStrategy's meshes are built in setup_environment(); use them after that")
        return self._data_context_parallel_mesh

    @property
    def context_parallel_mesh(self) -> DeviceMesh:
        """Ranks splitting each sequence (ring attention); they read the same batch and hold the same weights."""
        return self.device_mesh[CONTEXT_PARALLEL_DIM]

    @property
    def tensor_parallel_mesh(self) -> DeviceMesh:
        return self.device_mesh[TENSOR_PARALLEL_DIM]

    @property
    def pipeline_parallel_mesh(self) -> DeviceMesh:
        """Ranks holding consecutive pipeline stages of the same model replica."""
        return self.device_mesh[PIPELINE_PARALLEL_DIM]

    def setup_environment(self) -> None:
        super().setup_environment()
        self._parallel_dims = ParallelDims(
            self.world_size,
            tp=self.tensor_model_parallel_size,
            pp=self.pipeline_config.pipeline_model_parallel_size,
            cp=self.context_parallel_size,
            ep=self.expert_model_parallel_size,
        )
        self._device_mesh = self._parallel_dims.build_mesh(self.root_device.type)
        self._data_context_parallel_mesh = ParallelDims.data_context_parallel_mesh(self._device_mesh)
        self.checkpoint_io.set_data_parallel_group(self.data_context_parallel_mesh.get_group())
        self.checkpoint_io.start_writer_process(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not self.init_model_with_meta_device:
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._setup_model(self.model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _mixed_precision_dtype(self) -> torch.dtype | None:
        """bf16 under the Trainer's `precision="bf16-mixed"`, else None (compute in the parameters' dtype)."""
        precision = self.precision_plugin.precision
        if precision == "16-mixed" and self.ddp_config.shards_parameters:
            raise ValueError(
                "MegatronStrategy: precision='16-mixed' (fp16 with loss scaling) is not supported with sharded "
                "gradients; use precision='bf16-mixed'"
            )
        if precision == "16-mixed" and self.pipeline_config.enabled:
            raise ValueError(
                f"MegatronStrategy: precision='16-mixed' (fp16 with loss scaling) is not supported with "
                f"pipeline_model_parallel_size={self.pipeline_config.pipeline_model_parallel_size} (the schedule's "
                "backward does not scale the loss); use precision='bf16-mixed'"
            )
        return torch.bfloat16 if precision == "bf16-mixed" else None

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Apply the configured data parallelism to the LightningModule (materializing it if on `meta`)."""
        config = self.ddp_config
        compute_dtype = self._mixed_precision_dtype()
        if self.pipeline_config.enabled:
            return self._setup_pipeline_model(model, compute_dtype)
        sequence_shards = self.tensor_model_parallel_size if self.sequence_parallel else 1
        apply_context_parallel(
            model, self.context_parallel_mesh, self.data_context_parallel_mesh, self.cp_comm_type, sequence_shards
        )
        moe_layers = self._split_experts(model)
        if self._expert_mesh is not None and not config.shards_parameters:
            if self.tensor_model_parallel_size > 1:
                apply_tensor_parallel(model, self.tensor_parallel_mesh, self.sequence_parallel, self.root_device)
            materialize(model, self.root_device)
            self._expert_grad_reducer = ExpertParallelGradReducer(
                model.to(self.root_device),
                self.data_context_parallel_mesh.get_group(),
                self._expert_mesh[EXPERT_DATA_PARALLEL_DIM].get_group(),
            )
            return model
        if self.tensor_model_parallel_size > 1:
            apply_tensor_parallel(model, self.tensor_parallel_mesh, self.sequence_parallel, self.root_device)
            if not config.shards_parameters:
                model.to(self.root_device)
                if self.data_context_parallel_mesh.size() > 1:  # DDP cannot reduce DTensor gradients
                    self._tensor_parallel_grad_reducer = GradientAllReducer(
                        model, self.data_context_parallel_mesh.get_group(), config.overlap_grad_reduce
                    )
                return model
        if config.shards_parameters:
            if any(True for _ in model.parameters(recurse=False)):
                raise TypeError(
                    f"{type(model).__name__} holds parameters itself; FSDP shards its submodules, "
                    "so keep parameters in submodules (e.g. `self.module`)"
                )
            roots = [child for child in model.children() if any(True for _ in child.parameters())]
            self._fsdp_modules = self._shard_experts(moe_layers, compute_dtype) + apply_fsdp(
                roots, self.data_context_parallel_mesh, config, self.root_device, compute_dtype
            )
            return model
        materialize(model, self.root_device)
        model.to(self.root_device)
        grad_dtype = next(model.parameters()).dtype
        reduce_dtype = None if config.grad_reduce_in_fp32 or compute_dtype is None else compute_dtype
        return apply_ddp(
            model,
            self.data_context_parallel_mesh,
            config,
            self.determine_ddp_device_ids(),
            grad_dtype,
            reduce_dtype,
            **lightning_ddp_kwargs(self),
        )

    def _split_experts(self, model: nn.Module) -> list:
        """Keep this rank's experts (expert_model_parallel_size > 1) and give MoE layers their process groups."""
        dims = self.parallel_dims
        if self.expert_model_parallel_size > 1:
            self._expert_mesh = dims.build_expert_mesh(self.root_device.type)
        dp_mesh = self.data_context_parallel_mesh
        layers = apply_expert_parallel(
            model,
            self._expert_mesh,
            dp_mesh.get_group() if dp_mesh.size() > 1 else None,
            expert_tensor_parallel=self.expert_tensor_parallel_size > 1,
        )
        if self._expert_mesh is not None and not layers:
            raise ValueError(
                f"MegatronStrategy(expert_model_parallel_size={self.expert_model_parallel_size}) needs a model with "
                "experts (GPTConfig.num_moe_experts); set expert_model_parallel_size=1 for a dense model"
            )
        return layers

    def _shard_experts(self, moe_layers: list, compute_dtype: torch.dtype | None) -> list[FSDPModule]:
        """FSDP2 of split experts over the expert-data-parallel ranks (unsplit experts shard with their layer)."""
        if self._expert_mesh is None:
            return []
        config = self.ddp_config
        reduce_dtype = torch.float32 if config.grad_reduce_in_fp32 else compute_dtype
        return shard_experts_fsdp(
            moe_layers,
            self._expert_mesh,
            self.data_context_parallel_mesh.size(),
            self.root_device,
            MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype),
            reshard_after_forward=config.data_parallel_sharding_strategy == "optim_grads_params",
        )

    def _setup_pipeline_model(self, model: nn.Module, compute_dtype: torch.dtype | None) -> nn.Module:
        """Keep this rank's pipeline stages, apply tensor and data parallelism to them, build the schedule."""
        if not isinstance(model, PipelineSplittable):
            raise TypeError(
                f"pipeline_model_parallel_size > 1 needs a model that splits itself into stages (a `split_pipeline` "
                f"method, as nemo_ckpt's GPTModel has); {type(model).__name__} has none"
            )
        config, dp_mesh = self.ddp_config, self.data_context_parallel_mesh
        # on meta: each stage's modules start from the random state they would in the whole model
        init_end = record_init_rng_states(model, self.root_device) if has_meta_tensors(model) else None
        stages = model.split_pipeline(self.pipeline_parallel_mesh, self.pipeline_config.virtual_size)
        if self.context_parallel_size > 1:  # after the split: the stages' attention runs as a ring over cp
            sequence_shards = self.tensor_model_parallel_size if self.sequence_parallel else 1
            apply_context_parallel(model, self.context_parallel_mesh, dp_mesh, self.cp_comm_type, sequence_shards)
        if self.tensor_model_parallel_size > 1:
            apply_tensor_parallel(model, self.tensor_parallel_mesh, self.sequence_parallel, self.root_device)
        if config.shards_parameters:
            modules = [module for _, module in stages]
            self._fsdp_modules = apply_fsdp(modules, dp_mesh, config, self.root_device, compute_dtype)
        else:
            materialize(model, self.root_device)
            model.to(self.root_device)
        if init_end is not None:
            default_generator(self.root_device).set_state(init_end)  # where building the whole model leaves it
        self._tied_weight = tied_weight(model, self.device_mesh, PIPELINE_PARALLEL_DIM)
        if self._tied_weight is not None:
            self._tied_weight.broadcast()
        trainer = self.lightning_module.trainer
        num_microbatches = trainer.accumulate_grad_batches  # the pipeline runs them in one step
        trainer.accumulate_grad_batches = 1
        if not config.shards_parameters and dp_mesh.size() > 1:  # FSDP2 stages reduce in the schedule
            self._tensor_parallel_grad_reducer = (
                StageGradientReducer(stages, dp_mesh.get_group(), num_microbatches)
                if config.overlap_grad_reduce  # each stage's bucket while the other stages compute
                else GradientAllReducer(model, dp_mesh.get_group(), False)  # all at once after the schedule
            )
        pp_mesh = self.pipeline_parallel_mesh
        self._pipeline = PipelineRunner(
            self.pipeline_config, stages, pp_mesh, self.root_device, num_microbatches, model.pipeline_loss
        )
        return model

    def process_dataloader(self, dataloader: Any) -> Any:
        if self._pipeline is None:
            return super().process_dataloader(dataloader)
        return MicroBatchGroups(dataloader, self._pipeline.num_microbatches)  # a batch holds a step's micro-batches

    def _pipeline_step(self, closure_loss: torch.Tensor) -> torch.Tensor:
        """Run the pipeline schedule on the step's batch (after Lightning zeroed the gradients); reduce the
        gradients and log the loss as NeMo does."""
        module = self.lightning_module
        with self.precision_plugin.train_step_context():
            loss = self._pipeline.run(*self._pipeline_batch, train=True)
        self._pipeline_batch = None
        if self._tensor_parallel_grad_reducer is not None:
            self._tensor_parallel_grad_reducer.finish()
        if self._tied_weight is not None:
            self._tied_weight.all_reduce_grad()
        if self.ddp_config.check_for_nan_in_grad:
            check_grads_finite(module, dist.group.WORLD, module.trainer.global_step)
        module.log("reduced_train_loss", loss, prog_bar=True, sync_dist=True, batch_size=1)
        return closure_loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        self._pipeline_batch = module.pipeline_inputs(args[0])
        for scheduler in module.trainer.lr_scheduler_configs:
            module.log("lr", scheduler.scheduler.get_last_lr()[0], batch_size=1)
        return torch.zeros((), device=self.root_device)  # backward() runs the schedule

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        module = self.lightning_module
        with self.precision_plugin.val_step_context():
            loss = self._pipeline.run(*module.pipeline_inputs(args[0]), train=False)
        module.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=self._pipeline.num_microbatches)
        return loss

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The batch on this rank's device; with context parallelism, this cp rank's chunks of its sequences."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.context_parallel_size > 1:
            batch = split_batch(batch, self.context_parallel_size, self.context_parallel_mesh.get_local_rank())
        return batch

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._zero = {}
        if self.ddp_config.data_parallel_sharding_strategy == "optim":
            for optimizer in map(_unwrap, self.optimizers):
                self._zero[optimizer] = ZeroOneSharding(
                    optimizer,
                    self.lightning_module,
                    self.data_context_parallel_mesh.get_group(),
                    self.ddp_config.overlap_param_gather,
                )

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self._pipeline is not None:  # the schedule runs forward and backward once all micro-batches are in
            return self._pipeline_step(closure_loss)
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._tensor_parallel_grad_reducer is not None:
            self._tensor_parallel_grad_reducer.finish()
        if self._expert_grad_reducer is not None:
            self._expert_grad_reducer.finish()
        if self.ddp_config.check_for_nan_in_grad:
            check_grads_finite(self.lightning_module, dist.group.WORLD, self.lightning_module.trainer.global_step)
        return loss

    def _param_names(self) -> dict[nn.Parameter, str]:
        return {param: name for name, param in self.lightning_module.named_parameters()}

    def _settle_parameters(self) -> None:
        """Finish pending ZeRO-1 broadcasts and reshard FSDP2 units, so parameters are current and sharded."""
        for zero in self._zero.values():
            zero.wait_for_params()
        for module in self._fsdp_modules:
            module.reshard()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._settle_parameters()
        state_dict = self.lightning_module.state_dict()
        expert_replicas = {}
        if self._expert_mesh is not None:  # experts split: copies only among the edp ranks
            edp_rank = self._expert_mesh[EXPERT_DATA_PARALLEL_DIM].get_local_rank()
            expert_replicas = expert_replica_ids(state_dict, edp_rank)
        if self._tied_weight is not None and not self._tied_weight.is_first:  # written by the first stage
            expert_replicas[self._tied_weight.name] = 1 + self.data_context_parallel_mesh.get_local_rank()
        replica_id = self.data_context_parallel_mesh.get_local_rank()
        if self._pipeline is not None and self.ddp_config.shards_parameters:
            replica_id = 0  # FSDP2 shards over dp: no other copy (other pipeline stages hold other keys)
        return model_sharded_state_dict(state_dict, replica_id=replica_id, replica_ids=expert_replicas)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = _unwrap(optimizer)
        names = self._param_names()
        optim_state = named_optimizer_state(optimizer, names)
        if self._pipeline is not None:  # the common part holds every stage's names and scalar state
            optim_state = merge_pipeline_optimizer_state(optim_state, self.pipeline_parallel_mesh.get_group())
        zero = self._zero.get(optimizer)
        if zero is not None:
            zero.complete_named_state(optim_state, names)
        sharded = optimizer_sharded_state_dict(
            optim_state, self.lightning_module_state_dict(), state_replica_id=None if zero is None else 0
        )
        expert_replica_mesh = self.data_context_parallel_mesh
        if self._expert_mesh is not None:
            expert_replica_mesh = self._expert_mesh[EXPERT_DATA_PARALLEL_DIM]
            complete_expert_param_groups(sharded, self.lightning_module)
        tp_mesh = self.tensor_parallel_mesh  # the tp ranks hold copies of the experts' scalar state too
        replica_id = expert_replica_mesh.get_local_rank() * tp_mesh.size() + tp_mesh.get_local_rank()
        shard_expert_scalar_state(sharded, replica_id)
        return sharded

    def sharded_state_dict(self) -> dict[str, Any]:
        """The template a checkpoint is loaded into: model and optimizer entries, as in a saved checkpoint.

        Its tensors are the live parameters and optimizer state (created here if still empty), loaded in place.
        """
        for optimizer in self.optimizers:
            init_optimizer_state(_unwrap(optimizer))
        return {
            "state_dict": self.lightning_module_state_dict(),
            "optimizer_states": [self.optimizer_state(optimizer) for optimizer in self.optimizers],
        }

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """The optimizer's step, its update ordered after the last save's device-to-host copies, which so overlap
        the forward and backward that `closure` runs (`ckpt_async_overlap_staging`; the optimizer calls the closure
        before updating anything)."""

        def closure_then_order() -> Any:
            result = closure()
            self.checkpoint_io.order_after_staging()
            return result

        return super().optimizer_step(optimizer, closure_then_order, model, **kwargs)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        overlapped = self.checkpoint_io.options.ckpt_async_overlap_staging
        if overlapped and saves_gpu_buffers(self.lightning_module):  # the next forward may change them
            self.checkpoint_io.order_after_staging()

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint, its tensors loaded into the live ones; without `ckpt_load_optimizer`, only the model's,
        with the LR schedulers set to the checkpoint's step."""
        if self.ckpt_load_optimizer:
            require_optimizer_state(checkpoint_path, verify=self.checkpoint_io.options.ckpt_verify_on_load)
            return self.checkpoint_io.load_checkpoint(checkpoint_path, sharded_state_dict=self.sharded_state_dict())
        template = {"state_dict": self.lightning_module_state_dict()}
        checkpoint = self.checkpoint_io.load_checkpoint(checkpoint_path, sharded_state_dict=template)
        checkpoint.pop("optimizer_states", None)
        step = checkpoint["global_step"]
        schedulers = self.lightning_module.trainer.lr_scheduler_configs
        checkpoint["lr_schedulers"] = [{**config.scheduler.state_dict(), "last_epoch": step} for config in schedulers]
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        load_module_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        names = self._param_names()
        for optimizer, optim_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_named_optimizer_state(_unwrap(optimizer), names, optim_state)

    def teardown(self) -> None:
        self._settle_parameters()
        super().teardown()

    def remove_checkpoint(self, filepath: str | Path) -> None:
        self.barrier("remove_checkpoint")
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


def _unwrap(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside a LightningOptimizer."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

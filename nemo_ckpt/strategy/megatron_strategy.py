"""`MegatronStrategy`: NeMo's Lightning strategy on plain PyTorch, saving through `dist_checkpointing`.

Data parallelism follows `DistributedDataParallelConfig.data_parallel_sharding_strategy`: DDP (`no_shard`),
DDP with a ZeRO-1 sharded optimizer (`optim`) or FSDP2 (`optim_grads`, `optim_grads_params`), over the `dp`
dimension of a device mesh (gloo on CPU, NCCL on GPU). Checkpoints use layout-independent keys, so a run
resumes under any other sharding strategy and world size.
"""

from collections.abc import Generator, Mapping
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
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from nemo_ckpt._compat import lightning_ddp_kwargs, optimizers_to_device
from nemo_ckpt.options import UnsupportedOptionError, strict_options
from nemo_ckpt.parallel.ddp import apply_ddp
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.fsdp import apply_fsdp
from nemo_ckpt.parallel.gradients import GradientAllReducer, check_grads_finite
from nemo_ckpt.parallel.mesh import DATA_PARALLEL_DIM, TENSOR_PARALLEL_DIM, build_device_mesh
from nemo_ckpt.parallel.meta_init import materialize
from nemo_ckpt.parallel.tensor_parallel import apply_tensor_parallel
from nemo_ckpt.parallel.zero import ZeroOneSharding
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions
from nemo_ckpt.strategy.state_dict import (
    init_optimizer_state,
    load_module_state,
    load_named_optimizer_state,
    model_sharded_state_dict,
    named_optimizer_state,
    optimizer_sharded_state_dict,
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
    "pipeline_model_parallel_comm_backend": "the backend of pipeline-parallel send/recv; no pipeline parallelism here",
    "microbatch_group_size_per_vp_stage": "micro-batches per virtual pipeline stage; no pipeline parallelism here",
    "encoder_tensor_model_parallel_size": "tensor parallelism of an encoder (encoder-decoder models)",
    "encoder_pipeline_model_parallel_size": "pipeline stages of an encoder (encoder-decoder models)",
    "moe_extended_tp": "experts sharded over tensor-parallel ranks; no mixture of experts here",
    "num_distributed_optimizer_instances": "replicas of Megatron's distributed optimizer; ZeRO-1 here is "
    "data_parallel_sharding_strategy='optim'",
    "data_sampler": "NeMo's MegatronDataSampler; the data module's sampler is used here",
    "fsdp": "'megatron' or 'pytorch' FSDP; set ddp.data_parallel_sharding_strategy='optim_grads_params' (FSDP2)",
    "lazy_init": "build the model without allocating weights; use init_model_with_meta_device=True",
    "pipeline_dtype": "the dtype of pipeline-parallel activations; no pipeline parallelism here",
    "use_te_rng_tracker": "Transformer Engine's CUDA RNG tracker; no Transformer Engine here",
    "use_sharp": "SHARP in-network reductions for NCCL",
    "ckpt_load_optimizer": "whether a resume loads the optimizer state; it always does here (weights-only "
    "checkpoints are skipped by AutoResume)",
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
    "account_for_embedding_in_pipeline_split": "count the embedding as a pipeline layer; no pipeline parallelism",
    "account_for_loss_in_pipeline_split": "count the loss as a pipeline layer; no pipeline parallelism",
    "checkpoint_io": "a custom CheckpointIO; checkpoints go through DistCheckpointIO, set by the ckpt_* options",
    "ddp_comm_state": "a DDP communication hook's state (Lightning); gradients are reduced as `ddp` configures",
    "ddp_comm_hook": "a DDP communication hook (Lightning); gradients are reduced as `ddp` configures",
    "ddp_comm_wrapper": "a DDP communication hook wrapper (Lightning); gradients are reduced as `ddp` configures",
    "model_averaging_period": "Lightning's post-local SGD model averaging",
    "bucket_cap_mb": "DDP's bucket size in MB; set ddp.bucket_size (elements) instead",
}
# NeMo parallelisms this strategy does not implement: accepted at their NeMo default only.
NEMO_PARALLELISM_DEFAULTS = {
    "pipeline_model_parallel_size": (1, "layers split into pipeline stages over ranks"),
    "virtual_pipeline_model_parallel_size": (None, "interleaved pipeline stages per rank"),
    "context_parallel_size": (1, "sequences split over ranks (ring attention)"),
    "expert_model_parallel_size": (1, "mixture-of-experts experts spread over ranks"),
    "expert_tensor_parallel_size": (None, "tensor parallelism within experts"),
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
    """Data-parallel training (DDP, ZeRO-1 or FSDP2 from `ddp`) with sharded, reshardable checkpoints.

    `tensor_model_parallel_size`, `sequence_parallel`: Megatron's tensor (and sequence) parallelism on DTensor
    over the `tp` dimension of a (dp, tp) mesh (the model's own plan, e.g. nemo_ckpt/models/gpt/parallelize.py),
    applied before the data
    parallelism of `ddp` over `dp` (FSDP2 on the 2-D mesh; with `no_shard`, gradients are averaged over dp
    by `GradientAllReducer`). The data-parallel size is world size / tensor_model_parallel_size.
    `ddp`: a `DistributedDataParallelConfig`, or `"megatron"` / `"pytorch"` as in NeMo.
    `init_model_with_meta_device`: build the model on `meta` in `configure_model`, then materialize it module
    by module with `reset_parameters` while sharding, so no rank ever holds the whole model.
    bf16 mixed precision comes from the Trainer (`precision="bf16-mixed"`): fp32 parameters (the master
    weights), bf16 compute, gradients reduced in fp32 if `ddp.grad_reduce_in_fp32`, else in bf16.
    `ckpt_*`: `DistCheckpointOptions`. `pipeline_model_parallel_size`, `virtual_pipeline_model_parallel_size`,
    `context_parallel_size`, `expert_model_parallel_size`, `expert_tensor_parallel_size`: only NeMo's defaults
    (no such parallelism here). `find_unused_parameters`, `gradient_as_bucket_view`, `static_graph`,
    `broadcast_buffers`: torch DDP's, used with `ddp` `no_shard` or `optim` without tensor parallelism.
    `parallel_devices`, `cluster_environment`, `process_group_backend`, `timeout`: Lightning's DDPStrategy's.
    Any other argument is an error: a misspelt one names the closest option, a NeMo option not implemented here
    says what it means in NeMo (`NEMO_UNSUPPORTED`).
    """

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        sequence_parallel: bool = False,
        ddp: str | DistributedDataParallelConfig = "megatron",
        init_model_with_meta_device: bool = False,
        save_ckpt_format: str = "torch_dist",
        ckpt_async_save: bool = False,
        ckpt_parallel_save: bool = False,
        ckpt_parallel_save_within_dp: bool = False,
        ckpt_parallel_load: bool = False,
        ckpt_torch_dist_multiproc: int | None = None,
        ckpt_assume_constant_structure: bool = False,
        ckpt_parallel_save_optim: bool = False,
        ckpt_load_directly_on_device: bool = False,
        ckpt_load_strictness: str | None = None,
        ckpt_async_save_timeout: float | None = None,
        ckpt_async_save_failure: str = "raise",
        ckpt_verify_on_load: bool = False,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        context_parallel_size: int = 1,
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
        parallelism = {
            "pipeline_model_parallel_size": pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": virtual_pipeline_model_parallel_size,
            "context_parallel_size": context_parallel_size,
            "expert_model_parallel_size": expert_model_parallel_size,
            "expert_tensor_parallel_size": expert_tensor_parallel_size,
        }
        for name, (default, meaning) in NEMO_PARALLELISM_DEFAULTS.items():
            if parallelism[name] != default:
                raise UnsupportedOptionError(
                    f"MegatronStrategy: not supported: {name}={parallelism[name]!r} (NeMo meaning: {meaning}); "
                    f"leave it at {default!r}"
                )
        ddp_kwargs = {
            "find_unused_parameters": find_unused_parameters,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "broadcast_buffers": broadcast_buffers,
        }
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
        changed = [name for name, default in DDP_DEFAULTS.items() if ddp_kwargs[name] != default]
        if changed and (self.ddp_config.shards_parameters or tensor_model_parallel_size > 1):
            raise ValueError(
                f"MegatronStrategy({changed[0]}={ddp_kwargs[changed[0]]!r}) is an option of torch DDP, which is not "
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
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.sequence_parallel = sequence_parallel
        self.init_model_with_meta_device = init_model_with_meta_device
        self._device_mesh: DeviceMesh | None = None
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
    def device_mesh(self) -> DeviceMesh:
        """The (dp, tp) device mesh, built when the process group starts."""
        if self._device_mesh is None:
            raise RuntimeError("MegatronStrategy.device_mesh is built in setup_environment(); use it after that")
        return self._device_mesh

    @property
    def data_parallel_mesh(self) -> DeviceMesh:
        return self.device_mesh[DATA_PARALLEL_DIM]

    @property
    def tensor_parallel_mesh(self) -> DeviceMesh:
        return self.device_mesh[TENSOR_PARALLEL_DIM]

    def setup_environment(self) -> None:
        super().setup_environment()
        self._device_mesh = build_device_mesh(self.root_device.type, self.tensor_model_parallel_size, self.world_size)
        self.checkpoint_io.set_data_parallel_group(self.data_parallel_mesh.get_group())

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
        return torch.bfloat16 if precision == "bf16-mixed" else None

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Apply the configured data parallelism to the LightningModule (materializing it if on `meta`)."""
        config = self.ddp_config
        compute_dtype = self._mixed_precision_dtype()
        if self.tensor_model_parallel_size > 1:
            apply_tensor_parallel(model, self.tensor_parallel_mesh, self.sequence_parallel, self.root_device)
            if not config.shards_parameters:
                model.to(self.root_device)
                if self.data_parallel_mesh.size() > 1:  # DDP cannot reduce DTensor gradients
                    self._tensor_parallel_grad_reducer = GradientAllReducer(
                        model, self.data_parallel_mesh.get_group(), config.overlap_grad_reduce
                    )
                return model
        if config.shards_parameters:
            if any(True for _ in model.parameters(recurse=False)):
                raise TypeError(
                    f"{type(model).__name__} holds parameters itself; FSDP shards its submodules, "
                    "so keep parameters in submodules (e.g. `self.module`)"
                )
            roots = [child for child in model.children() if any(True for _ in child.parameters())]
            self._fsdp_modules = apply_fsdp(roots, self.data_parallel_mesh, config, self.root_device, compute_dtype)
            return model
        materialize(model, self.root_device)
        model.to(self.root_device)
        grad_dtype = next(model.parameters()).dtype
        reduce_dtype = None if config.grad_reduce_in_fp32 or compute_dtype is None else compute_dtype
        return apply_ddp(
            model,
            self.data_parallel_mesh,
            config,
            self.determine_ddp_device_ids(),
            grad_dtype,
            reduce_dtype,
            **lightning_ddp_kwargs(self),
        )

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._zero = {}
        if self.ddp_config.data_parallel_sharding_strategy == "optim":
            for optimizer in map(_unwrap, self.optimizers):
                self._zero[optimizer] = ZeroOneSharding(
                    optimizer,
                    self.lightning_module,
                    self.data_parallel_mesh.get_group(),
                    self.ddp_config.overlap_param_gather,
                )

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._tensor_parallel_grad_reducer is not None:
            self._tensor_parallel_grad_reducer.finish()
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
        return model_sharded_state_dict(
            self.lightning_module.state_dict(), replica_id=self.data_parallel_mesh.get_local_rank()
        )

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = _unwrap(optimizer)
        names = self._param_names()
        optim_state = named_optimizer_state(optimizer, names)
        zero = self._zero.get(optimizer)
        if zero is not None:
            zero.complete_named_state(optim_state, names)
        return optimizer_sharded_state_dict(
            optim_state, self.lightning_module_state_dict(), state_replica_id=None if zero is None else 0
        )

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

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(checkpoint_path, sharded_state_dict=self.sharded_state_dict())

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

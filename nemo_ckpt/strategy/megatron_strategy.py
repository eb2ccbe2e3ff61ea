"""`MegatronStrategy`: NeMo's Lightning strategy on plain PyTorch, saving through `dist_checkpointing`.

A thin Lightning adapter: it checks the options (`ParallelismConfig`), builds the meshes when the process group
starts (`ParallelDims`), hands the model to `nemo_ckpt.parallel.plan.parallelize` at setup and keeps the result
(`ParallelModel`), runs the step (the pipeline schedule where there is one), and passes checkpoints to
`DistCheckpointIO` as state dicts whose layout rules come from the active parallelisms. Checkpoints use
layout-independent keys, so a run resumes under any other layout and world size.
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
from torch.optim import Optimizer

from nemo_ckpt._compat import lightning_ddp_kwargs, optimizers_to_device
from nemo_ckpt.options import flat_options, strict_options
from nemo_ckpt.parallel.config import PARALLELISM_OPTIONS, ParallelismConfig
from nemo_ckpt.parallel.context_parallel import split_batch
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig
from nemo_ckpt.parallel.gradients import check_grads_finite
from nemo_ckpt.parallel.mesh import ParallelDims
from nemo_ckpt.parallel.pipeline import MicroBatchGroups, PipelineConfig
from nemo_ckpt.parallel.plan import ParallelModel, parallelize
from nemo_ckpt.strategy.checkpoint_io import DistCheckpointIO, DistCheckpointOptions, require_optimizer_state
from nemo_ckpt.strategy.megatron_options import NEMO_UNSUPPORTED, ddp_config_from, torch_ddp_kwargs
from nemo_ckpt.strategy.state_dict import (
    init_optimizer_state,
    load_module_state,
    load_named_optimizer_state,
    parameter_names,
    saves_gpu_buffers,
    sharded_model_state,
    sharded_optimizer_state,
)


@strict_options(NEMO_UNSUPPORTED)
@flat_options(ParallelismConfig, DistCheckpointOptions)
class MegatronStrategy(DDPStrategy):
    """Megatron-style parallel training with sharded, reshardable checkpoints on a (pp, dp, cp, tp) mesh; the
    data-parallel size is what the world size leaves after pp x cp x tp. The options are checked together as a
    `ParallelismConfig` (`self.parallelism`), applied in one order at setup (`nemo_ckpt.parallel.plan`), and
    `self.parallel_dims` answers every question about the layout (sizes, meshes, ranks, groups).

    `ddp`: a `DistributedDataParallelConfig` (DDP, ZeRO-1 or FSDP2 over dp x cp), or `"megatron"` / `"pytorch"`.
    `tensor_model_parallel_size`, `sequence_parallel`: tensor (and sequence) parallelism on DTensor over `tp`, with
    the model's own plan (e.g. nemo_ckpt/models/gpt/parallelize.py).
    `pipeline_model_parallel_size`, `virtual_pipeline_model_parallel_size`, `microbatch_group_size_per_vp_stage`,
    `pipeline_dtype`, `pipeline_schedule`: pipeline parallelism over `pp` (`nemo_ckpt/parallel/pipeline.py`).
    `context_parallel_size`, `cp_comm_type`: sequences split over `cp`, ring attention.
    `expert_model_parallel_size`: MoE experts split over that many ranks of dp x cp; `expert_tensor_parallel_size`:
    each expert sharded over tp (None, the default, or `tensor_model_parallel_size`) or whole on every tp rank (1).
    `init_model_with_meta_device`: build the model on `meta`, then materialize it module by module while sharding.
    bf16 mixed precision comes from the Trainer (`precision="bf16-mixed"`): fp32 master weights, bf16 compute,
    gradients reduced in fp32 if `ddp.grad_reduce_in_fp32`, else in bf16.
    `ckpt_*`: the fields of `DistCheckpointOptions` (declared there once), and `ckpt_load_optimizer`: False resumes
    a checkpoint's weights at its step with a fresh optimizer and the run's LR schedule at that step. With
    `ckpt_async_overlap_staging`, code that changes parameters or optimizer state in place outside the optimizer
    (e.g. swapping in averaged weights for validation) calls `trainer.strategy.checkpoint_io.order_after_staging()`.
    `find_unused_parameters`, `gradient_as_bucket_view`, `static_graph`, `broadcast_buffers`: torch DDP's (with
    `ddp` `no_shard` or `optim`, without tensor parallelism). `parallel_devices`, `cluster_environment`,
    `process_group_backend`, `timeout`: Lightning's DDPStrategy's. Any other argument is an error: a misspelt one
    names the closest option; a NeMo option not implemented here says what it means in NeMo (`NEMO_UNSUPPORTED`).
    """

    def __init__(
        self,
        *,
        ddp: str | DistributedDataParallelConfig = "megatron",
        init_model_with_meta_device: bool = False,
        ckpt_load_optimizer: bool = True,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        broadcast_buffers: bool = True,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        **options: Any,
    ) -> None:
        parallel_options = {name: options.pop(name) for name in PARALLELISM_OPTIONS if name in options}
        self.parallelism = ParallelismConfig(**parallel_options, ddp=ddp_config_from(ddp))
        ddp_kwargs = torch_ddp_kwargs(
            self.parallelism,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            broadcast_buffers=broadcast_buffers,
        )
        super().__init__(
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=DistCheckpointIO(DistCheckpointOptions(**options)),
            process_group_backend=process_group_backend,
            timeout=timeout,
            **ddp_kwargs,
        )
        self.init_model_with_meta_device = init_model_with_meta_device
        self.ckpt_load_optimizer = ckpt_load_optimizer
        self._parallel_dims: ParallelDims | None = None
        self._parallel: ParallelModel | None = None
        self._pipeline_batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def __getattr__(self, name: str) -> Any:
        """NeMo's attribute of each parallelism option (`strategy.tensor_model_parallel_size`), from `parallelism`."""
        if name in PARALLELISM_OPTIONS and "parallelism" in self.__dict__:
            return getattr(self.parallelism, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def ddp_config(self) -> DistributedDataParallelConfig:
        return self.parallelism.ddp

    @property
    def pipeline_config(self) -> PipelineConfig:
        return self.parallelism.pipeline

    @property
    def parallel_dims(self) -> ParallelDims:
        """The layout: each dimension's size, mesh, ranks and groups, known when the process group starts."""
        if self._parallel_dims is None:
            raise RuntimeError("MegatronStrategy.parallel_dims is set in setup_environment(); use it after that")
        return self._parallel_dims

    @property
    def parallel(self) -> ParallelModel:
        """The parallelized model and what training needs of it (`nemo_ckpt.parallel.plan`), after `setup`."""
        if self._parallel is None:
            raise RuntimeError("MegatronStrategy.parallel is built in setup(); use it after that")
        return self._parallel

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.ckpt_load_optimizer

    def setup_environment(self) -> None:
        super().setup_environment()
        self._parallel_dims = self.parallelism.dims(self.world_size).build_meshes(self.root_device.type)
        self.checkpoint_io.set_data_parallel_group(self._parallel_dims.dp_cp_mesh.get_group())
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
        compute_dtype = self.parallelism.compute_dtype(self.precision_plugin.precision)
        num_microbatches = trainer.accumulate_grad_batches
        if self.pipeline_config.enabled:
            trainer.accumulate_grad_batches = 1  # the pipeline runs a step's micro-batches in one schedule
        ddp_kwargs = {"device_ids": self.determine_ddp_device_ids(), **lightning_ddp_kwargs(self)}
        dims, device = self.parallel_dims, self.root_device
        self._parallel = parallelize(
            self.model, self.parallelism, dims, device, compute_dtype, num_microbatches, ddp_kwargs
        )
        self.model = self._parallel.module
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.ddp_config.data_parallel_sharding_strategy == "optim":
            optimizers = [_unwrap(optimizer) for optimizer in self.optimizers]
            self.parallel.shard_optimizers(optimizers, self.lightning_module, self.ddp_config.overlap_param_gather)

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any) -> None:
        self.checkpoint_io.maybe_finalize(blocking=False)  # complete async saves that have been written
        super().on_train_batch_start(batch, batch_idx, *args)

    def process_dataloader(self, dataloader: Any) -> Any:
        pipeline = self.parallel.pipeline
        if pipeline is None:
            return super().process_dataloader(dataloader)
        return MicroBatchGroups(dataloader, pipeline.num_microbatches)  # a batch holds a step's micro-batches

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """The batch on this rank's device; with context parallelism, this cp rank's chunks of its sequences."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        dims = self.parallel_dims
        if dims.cp > 1:
            batch = split_batch(batch, dims.cp, dims.cp_mesh.get_local_rank())
        return batch

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.parallel.pipeline is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        self._pipeline_batch = module.pipeline_inputs(args[0])
        for scheduler in module.trainer.lr_scheduler_configs:
            module.log("lr", scheduler.scheduler.get_last_lr()[0], batch_size=1)
        return torch.zeros((), device=self.root_device)  # backward() runs the schedule

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        pipeline = self.parallel.pipeline
        if pipeline is None:
            return super().validation_step(*args, **kwargs)
        module = self.lightning_module
        with self.precision_plugin.val_step_context():
            loss = pipeline.run(*module.pipeline_inputs(args[0]), train=False)
        module.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=pipeline.num_microbatches)
        return loss

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        pipeline = self.parallel.pipeline
        if pipeline is None:
            loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        else:  # the schedule runs forward and backward once all micro-batches are in
            with self.precision_plugin.train_step_context():
                reduced_loss = pipeline.run(*self._pipeline_batch, train=True)
            self._pipeline_batch = None
            loss = closure_loss
        self.parallel.finish_gradients()
        module = self.lightning_module
        if self.ddp_config.check_for_nan_in_grad:
            check_grads_finite(module, dist.group.WORLD, module.trainer.global_step)
        if pipeline is not None:  # logged as NeMo does
            module.log("reduced_train_loss", reduced_loss, prog_bar=True, sync_dist=True, batch_size=1)
        return loss

    def lightning_module_state_dict(self) -> dict[str, Any]:
        self.parallel.settle()
        replica_id = self.parallel_dims.dp_cp_mesh.get_local_rank()
        return sharded_model_state(self.lightning_module, self.parallel.rules, replica_id)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        model_state = self.lightning_module_state_dict()
        return sharded_optimizer_state(_unwrap(optimizer), self.lightning_module, self.parallel.rules, model_state)

    def sharded_state_dict(self) -> dict[str, Any]:
        """The template a checkpoint is loaded into: model and optimizer entries, as in a saved checkpoint.

        Its tensors are the live parameters and optimizer state (created here if still empty), loaded in place.
        """
        for optimizer in self.optimizers:
            init_optimizer_state(_unwrap(optimizer))
        model_state = self.lightning_module_state_dict()  # once: every optimizer's state is sharded like it
        module, rules = self.lightning_module, self.parallel.rules
        optimizers = [_unwrap(optimizer) for optimizer in self.optimizers]
        return {
            "state_dict": model_state,
            "optimizer_states": [sharded_optimizer_state(opt, module, rules, model_state) for opt in optimizers],
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
        names = parameter_names(self.lightning_module)
        for optimizer, optim_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_named_optimizer_state(_unwrap(optimizer), names, optim_state)

    def teardown(self) -> None:
        if self._parallel is not None:
            self._parallel.settle()
        super().teardown()

    def remove_checkpoint(self, filepath: str | Path) -> None:
        self.barrier("remove_checkpoint")
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


def _unwrap(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside a LightningOptimizer."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

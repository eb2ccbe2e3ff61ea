"""`MegatronStrategy`'s options beside the declared ones: NeMo's options it refuses (with their NeMo meaning), its
`ddp` argument, and torch DDP's pass-through options."""

from typing import Any

from nemo_ckpt.parallel.config import ParallelismConfig
from nemo_ckpt.parallel.ddp_config import DistributedDataParallelConfig


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


def torch_ddp_kwargs(parallelism: ParallelismConfig, **options: bool) -> dict[str, Any]:
    """The torch DDP `options` changed from their defaults (only those reach torch: torch 2.13 warns whenever
    `broadcast_buffers` is passed, deprecated for `forward_sync_buffers`, whose False, unlike
    `broadcast_buffers=False`, still syncs buffers at init). An error where torch DDP is not used."""
    kwargs = {name: value for name, value in options.items() if value != DDP_DEFAULTS[name]}
    if kwargs and (parallelism.ddp.shards_parameters or parallelism.tensor_model_parallel_size > 1):
        name, value = next(iter(kwargs.items()))
        raise ValueError(
            f"MegatronStrategy({name}={value!r}) is an option of torch DDP, which is not "
            "used with FSDP2 (ddp.data_parallel_sharding_strategy='optim_grads[_params]') or tensor parallelism; "
            "remove it"
        )
    return kwargs

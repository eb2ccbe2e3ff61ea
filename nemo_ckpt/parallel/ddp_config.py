"""`DistributedDataParallelConfig`: how `MegatronStrategy` shards and synchronizes data-parallel training.

The names are Megatron-Core's (`megatron.core.distributed.DistributedDataParallelConfig`):

    ddp = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                        overlap_param_gather=True, grad_reduce_in_fp32=True)
"""

import importlib
from dataclasses import dataclass

from torch import nn

from nemo_ckpt.options import strict_options

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

# Megatron-Core DistributedDataParallelConfig fields not implemented here, with what they mean there.
MEGATRON_UNSUPPORTED = {
    "use_distributed_optimizer": "shard the optimizer state over data-parallel ranks; set "
    "data_parallel_sharding_strategy='optim' (ZeRO-1) or 'optim_grads_params' (FSDP2) instead",
    "num_distributed_optimizer_instances": "replicas of the distributed optimizer across data-parallel groups",
    "align_param_gather": "align the parameter all-gathers of pipeline stages; no pipeline parallelism here",
    "check_for_large_grads": "raise on unexpectedly large gradients",
    "pad_buckets_for_high_nccl_busbw": "pad gradient buckets to NCCL-friendly sizes",
    "fp8_param_gather": "all-gather parameters in fp8 (Transformer Engine)",
    "reuse_grad_buf_for_mxfp8_param_ag": "reuse the gradient buffer for MXFP8 parameter all-gathers",
    "use_megatron_fsdp": "Megatron's own FSDP; set data_parallel_sharding_strategy='optim_grads_params' (FSDP2)",
    "use_custom_fsdp": "Megatron's own FSDP; set data_parallel_sharding_strategy='optim_grads_params' (FSDP2)",
    "gradient_reduce_div_fusion": "fuse the gradient division into the reduce-scatter (Megatron FSDP)",
    "suggested_communication_unit_size": "Megatron FSDP's communication unit size",
    "preserve_fp32_weights": "keep fp32 weights with fp8 parameters (Megatron FSDP)",
    "keep_fp8_transpose_cache": "keep the fp8 transpose cache (Megatron FSDP)",
    "nccl_ub": "NCCL user buffers for Megatron FSDP",
    "fsdp_double_buffer": "double-buffered Megatron FSDP all-gathers",
    "outer_dp_sharding_strategy": "hybrid sharding over an outer data-parallel group",
    "disable_symmetric_registration": "NCCL symmetric memory registration",
    "delay_wgrad_compute": "delay weight-gradient computation to overlap it with communication",
}


@strict_options(MEGATRON_UNSUPPORTED)
@dataclass
class DistributedDataParallelConfig:
    """Data-parallel sharding and communication.

    data_parallel_sharding_strategy:
        `no_shard`: DDP, everything replicated. `optim`: ZeRO-1, DDP with each optimizer state held by one rank.
        `optim_grads`: FSDP2 keeping parameters gathered from forward to backward (ZeRO-2-like).
        `optim_grads_params`: FSDP2 resharding after forward (ZeRO-3).
    overlap_grad_reduce: reduce gradients bucket by bucket during backward (DDP; FSDP2 always reduce-scatters
        each unit as its backward finishes). Off: one all-reduce after backward.
    overlap_param_gather: gather the next unit's parameters while computing this one (FSDP2 forward/backward
        prefetch; ZeRO-1: the updated parameters' broadcast overlaps the next forward). Needs sharding.
    grad_reduce_in_fp32: with bf16 mixed precision, reduce gradients in fp32 (else in bf16).
    bucket_size: DDP gradient bucket size in elements (None: Megatron's max(40M, 1M * data-parallel size)).
    average_in_collective: average with the collective (NCCL's AVG); off: divide by the data-parallel size, then sum.
    check_for_nan_in_grad: raise, naming the parameters, if a gradient holds NaN or Inf after backward.
    fsdp_unit_modules: import paths of the module classes FSDP2 shards as one unit (all-gathered and freed
        together); the rest belongs to the root unit. None: the units the model declares (its modules'
        `fsdp_unit_modules` class attribute; the GPT's transformer layers and embedding).
    """

    data_parallel_sharding_strategy: str = "no_shard"
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = False
    bucket_size: int | None = None
    average_in_collective: bool = False
    check_for_nan_in_grad: bool = False
    fsdp_unit_modules: list[str] | None = None

    def __post_init__(self) -> None:
        strategy = self.data_parallel_sharding_strategy
        if strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f"DistributedDataParallelConfig.data_parallel_sharding_strategy={strategy!r} is unknown; "
                f"choose one of {list(SHARDING_STRATEGIES)}"
            )
        if self.overlap_param_gather and strategy == "no_shard":
            raise ValueError(
                "DistributedDataParallelConfig.overlap_param_gather=True needs sharded parameters or optimizer "
                "state; set data_parallel_sharding_strategy to 'optim', 'optim_grads' or 'optim_grads_params', "
                "or overlap_param_gather=False"
            )
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(
                f"DistributedDataParallelConfig.bucket_size={self.bucket_size} must be a positive number of "
                "elements, or None for the default"
            )
        self.fsdp_unit_module_classes()

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters and gradients are sharded with FSDP2 (`optim_grads`, `optim_grads_params`)."""
        return self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")

    def fsdp_unit_module_classes(self) -> tuple[type[nn.Module], ...] | None:
        """The classes named by `fsdp_unit_modules` (None: the model's own)."""
        if self.fsdp_unit_modules is None:
            return None
        return tuple(import_module_class(path) for path in self.fsdp_unit_modules)

    def ddp_bucket_cap_mb(self, data_parallel_size: int, element_size: int, total_elements: int) -> float:
        """DDP's `bucket_cap_mb`: `bucket_size` elements, or all gradients in one bucket without overlap."""
        if not self.overlap_grad_reduce:
            return (total_elements * element_size) / 2**20 + 1
        elements = self.bucket_size or max(40_000_000, 1_000_000 * data_parallel_size)
        return elements * element_size / 2**20


def import_module_class(path: str) -> type[nn.Module]:
    """`package.module.Class` -> the class; one clear error naming `fsdp_unit_modules` if it is not a module."""
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(
            f"DistributedDataParallelConfig.fsdp_unit_modules entry {path!r} is not an importable torch.nn.Module "
            "class; give its full import path, e.g. 'nemo_ckpt.models.gpt.TransformerLayer'"
        )
    return cls

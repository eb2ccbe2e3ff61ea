"""Communication overlap: NeMo's `MegatronCommOverlapCallback` tensor- and pipeline-parallel options, validated.

Pipeline send/receive (`overlap_p2p_comm`, `batch_p2p_comm`) go to the strategy's `PipelineConfig`, which
chooses how torch's schedules post them (`nemo_ckpt/parallel/pipeline.py`); they run on every device.

In Megatron, the pipelined all-gather/reduce-scatter overlaps (`tp_comm_overlap_ag`, `tp_comm_overlap_rs`) and
the bulk overlaps (`tp_comm_bulk_dgrad`, `tp_comm_bulk_wgrad`) are Transformer Engine userbuffers kernels,
switched on by `tp_comm_overlap=True` (NeMo 1.0: `ub_tp_comm_overlap`) and tuned by `tp_comm_overlap_cfg`
(a `TransformerLayerTPOverlapCfg`); they need CUDA GPUs and sequence parallelism. On CPU nothing of this can
run: any overlap asked for is rejected with a message saying so, and TP collectives run one after another on
gloo.

On CUDA, `tp_comm_overlap=True` is torch's async tensor parallelism, the counterpart of the pipelined AG/RS
overlaps: Inductor's micro-pipeline TP (see `nemo_ckpt._compat.enable_async_tensor_parallel`) rewrites
all-gather + matmul and matmul + reduce-scatter into chunked, overlapped `fused_all_gather_matmul` /
`fused_matmul_reduce_scatter` on symmetric memory (`enable_symm_mem_for_group` on the tp group). It applies
to `torch.compile`d code only. Userbuffers tuning (`tp_comm_overlap_cfg`) and the bulk overlaps have no torch
counterpart and are rejected on every device.
"""

from dataclasses import dataclass, fields

import lightning.pytorch as pl
import torch

from nemo_ckpt._compat import enable_async_tensor_parallel
from nemo_ckpt.parallel.config import parallelism_of
from nemo_ckpt.parallel.mesh import parallel_dims_of

BOOTSTRAP_BACKENDS = ("nccl", "mpi", "gloo")


@dataclass
class TPOverlapCfg:
    """Base of the per-GEMM userbuffers settings (NeMo's `tp_overlap_configs.userbuffers`)."""


@dataclass
class PipelineOverlapCfg(TPOverlapCfg):
    """Chunked (pipelined) overlap of one GEMM with its collective."""

    num_sm: int
    cga_size: int
    num_splits: int
    set_sm_margin: bool
    fp8_buf: bool = False
    atomic_gemm: bool = False
    method: str = "pipeline"


@dataclass
class RingExchangeOverlapCfg(TPOverlapCfg):
    """Overlap of one GEMM with point-to-point ring exchanges."""

    aggregate: bool = False
    method: str = "ring_exchange"
    num_sm: int = 1
    cga_size: int = 1
    set_sm_margin: bool = False
    fp8_buf: bool = False
    atomic_gemm: bool = False


@dataclass
class BulkOverlapCfg(TPOverlapCfg):
    """Bulk overlap of a collective with an independent GEMM."""

    num_sm: int
    cga_size: int
    set_sm_margin: bool
    method: str = "bulk"


@dataclass
class TransformerLayerTPOverlapCfg:
    """Userbuffers settings for every TP GEMM of a transformer layer (None: that GEMM is not overlapped)."""

    qkv_dgrad: TPOverlapCfg | None = None
    qkv_wgrad: TPOverlapCfg | None = None
    fc1_dgrad: TPOverlapCfg | None = None
    fc1_wgrad: TPOverlapCfg | None = None
    qkv_fprop: TPOverlapCfg | None = None
    proj_dgrad: TPOverlapCfg | None = None
    fc1_fprop: TPOverlapCfg | None = None
    fc2_dgrad: TPOverlapCfg | None = None
    proj_fprop: TPOverlapCfg | None = None
    fc2_fprop: TPOverlapCfg | None = None


@dataclass
class TPCommOverlapConfig:
    """Tensor-parallel communication overlap, with Megatron-Core's and NeMo's option names.

    tp_comm_overlap: overlap TP collectives with GEMMs (needs CUDA, tensor_model_parallel_size > 1 and
        sequence_parallel=True).
    tp_comm_overlap_cfg: Transformer Engine userbuffers tuning per GEMM; not supported (no TE).
    tp_comm_bootstrap_backend: process group that bootstraps userbuffers: 'nccl', 'mpi' or 'gloo'.
    tp_comm_overlap_ag, tp_comm_overlap_rs: the pipelined all-gather / reduce-scatter overlaps. None: on with
        tp_comm_overlap. Torch's async TP overlaps both together, so they cannot differ.
    tp_comm_bulk_dgrad, tp_comm_bulk_wgrad: the bulk overlaps. None: on where they exist (TE only, so off here).
    """

    tp_comm_overlap: bool = False
    tp_comm_overlap_cfg: TransformerLayerTPOverlapCfg | None = None
    tp_comm_bootstrap_backend: str = "nccl"
    tp_comm_overlap_ag: bool | None = None
    tp_comm_overlap_rs: bool | None = None
    tp_comm_bulk_dgrad: bool | None = None
    tp_comm_bulk_wgrad: bool | None = None

    def __post_init__(self) -> None:
        if self.tp_comm_bootstrap_backend not in BOOTSTRAP_BACKENDS:
            raise ValueError(
                f"tp_comm_bootstrap_backend={self.tp_comm_bootstrap_backend!r} is unknown; "
                f"choose one of {list(BOOTSTRAP_BACKENDS)}"
            )

    def validate(self, device_type: str, tensor_model_parallel_size: int, sequence_parallel: bool) -> None:
        """Raise one clear error for an overlap this device and parallel layout cannot provide."""
        requested = [f.name for f in fields(self) if f.name.startswith("tp_comm_") and getattr(self, f.name) is True]
        if device_type != "cuda" and requested:
            raise ValueError(
                f"{', '.join(f'{name}=True' for name in requested)}: tensor-parallel communication overlap needs "
                f"GPU-only kernels (Transformer Engine userbuffers, or torch async TP on CUDA symmetric memory) "
                f"and this run is on {device_type!r}; leave these options unset (TP collectives then run "
                "unoverlapped)"
            )
        if self.tp_comm_overlap_cfg is not None:
            raise ValueError(
                "tp_comm_overlap_cfg tunes Transformer Engine userbuffers, which nemo_ckpt does not "
                "use; leave it None (torch async TP needs no tuning)"
            )
        bulk = [name for name in ("tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad") if getattr(self, name)]
        if bulk:
            raise ValueError(
                f"{', '.join(f'{name}=True' for name in bulk)}: bulk TP overlap exists only in "
                "Transformer Engine userbuffers; leave it unset"
            )
        if not self.tp_comm_overlap:
            pipelined = [name for name in ("tp_comm_overlap_ag", "tp_comm_overlap_rs") if getattr(self, name)]
            if pipelined:
                raise ValueError(
                    f"{', '.join(f'{name}=True' for name in pipelined)} takes effect only with "
                    "tp_comm_overlap=True; set tp_comm_overlap=True or leave it unset"
                )
            return
        if tensor_model_parallel_size < 2 or not sequence_parallel:
            raise ValueError(
                f"tp_comm_overlap=True overlaps the all-gathers and reduce-scatters of sequence parallelism; "
                f"it needs tensor_model_parallel_size > 1 (got {tensor_model_parallel_size}) and "
                f"sequence_parallel=True (got {sequence_parallel})"
            )
        if (self.tp_comm_overlap_ag is False) != (self.tp_comm_overlap_rs is False):
            raise ValueError(
                f"tp_comm_overlap_ag={self.tp_comm_overlap_ag}, tp_comm_overlap_rs={self.tp_comm_overlap_rs}: "
                "torch async TP overlaps all-gathers and reduce-scatters together; set both alike"
            )

    @property
    def overlaps_all_gather_and_reduce_scatter(self) -> bool:
        """Whether async TP is on: `tp_comm_overlap`, unless the AG and RS overlaps are both switched off."""
        return self.tp_comm_overlap and self.tp_comm_overlap_ag is not False


class MegatronCommOverlapCallback(pl.Callback):
    """NeMo's callback for communication overlap: validates the options against the strategy at setup; on CUDA,
    turns on torch async TP for the strategy's tp mesh; sets the pipeline send/receive options
    (`overlap_p2p_comm`, `batch_p2p_comm`; None: the schedule's default) on the strategy's pipeline.

        trainer = pl.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2, sequence_parallel=True),
                             callbacks=[MegatronCommOverlapCallback(tp_comm_overlap=True)])
    """

    def __init__(
        self,
        tp_comm_overlap: bool = False,
        tp_comm_overlap_cfg: TransformerLayerTPOverlapCfg | None = None,
        tp_comm_bootstrap_backend: str = "nccl",
        tp_comm_overlap_ag: bool | None = None,
        tp_comm_overlap_rs: bool | None = None,
        tp_comm_bulk_dgrad: bool | None = None,
        tp_comm_bulk_wgrad: bool | None = None,
        overlap_p2p_comm: bool | None = None,
        batch_p2p_comm: bool | None = None,
    ) -> None:
        self.config = TPCommOverlapConfig(
            tp_comm_overlap,
            tp_comm_overlap_cfg,
            tp_comm_bootstrap_backend,
            tp_comm_overlap_ag,
            tp_comm_overlap_rs,
            tp_comm_bulk_dgrad,
            tp_comm_bulk_wgrad,
        )
        self.p2p_options = {
            key: value
            for key, value in (("overlap_p2p_comm", overlap_p2p_comm), ("batch_p2p_comm", batch_p2p_comm))
            if value is not None
        }

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        parallelism = parallelism_of(trainer)
        device_type = torch.device(strategy.root_device).type
        self.config.validate(device_type, parallelism.tensor_model_parallel_size, parallelism.sequence_parallel)
        if self.config.overlaps_all_gather_and_reduce_scatter:
            enable_async_tensor_parallel(parallel_dims_of(trainer).tp_mesh.get_group().group_name)
        if self.p2p_options:
            if not hasattr(strategy, "parallelism"):
                raise ValueError(
                    f"MegatronCommOverlapCallback({', '.join(f'{k}={v}' for k, v in self.p2p_options.items())}): "
                    f"pipeline send/receive options need MegatronStrategy, not {type(strategy).__name__}"
                )
            strategy.parallelism = parallelism.with_pipeline_options(**self.p2p_options)

"""The GPT split into pipeline stages by transformer layers (Megatron-Core's layout).

With `pipeline_model_parallel_size` P and `virtual_pipeline_model_parallel_size` V, the model becomes P x V
stages; pipeline rank r runs the virtual stages r, r + P, ..., r + (V - 1) P (Megatron's interleaved order).
The embedding goes with the first stage, the final norm, output layer and loss with the last. Rank 0 holds
`num_layers_in_first_pipeline_stage` layers and rank P - 1 `num_layers_in_last_pipeline_stage` where given,
the other ranks share the rest evenly, and each rank's layers are split evenly over its V virtual stages.

A rank keeps one `GPT` holding all its layers, keyed by global index, so checkpoint keys stay
`module.layers.{i}` under any split; each stage is a `GPT` view sharing that one's modules. With tied
embeddings (`share_embeddings_and_output_weights`) the last stage keeps its own copy of the embedding weight,
kept equal to the first stage's by summing their gradients over the embedding group (as Megatron does).
"""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

from nemo_ckpt.models.gpt.model import GPT, GPTConfig, LayerDict, TransformerLayer
from nemo_ckpt.models.gpt.parallelize import tensor_parallel_plan, validate_tensor_parallel


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: its global index, its layers and whether it embeds (first) and outputs (last)."""

    stage_index: int
    num_stages: int
    layer_ids: tuple[int, ...]

    @property
    def pre_process(self) -> bool:
        return self.stage_index == 0

    @property
    def post_process(self) -> bool:
        return self.stage_index == self.num_stages - 1


def layers_per_rank(config: GPTConfig, pipeline_size: int, virtual_size: int = 1) -> list[int]:
    """How many transformer layers each pipeline rank holds; a clear error if they do not split."""
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if pipeline_size == 1:
        if first is not None or last is not None:
            raise ValueError(
                "GPTConfig.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage need "
                "pipeline_model_parallel_size > 1; unset them"
            )
        counts = [config.num_layers]
    else:
        uneven = {rank: count for rank, count in ((0, first), (pipeline_size - 1, last)) if count is not None}
        others = pipeline_size - len(uneven)
        remaining = config.num_layers - sum(uneven.values())
        if (others == 0 and remaining != 0) or (others > 0 and (remaining <= 0 or remaining % others)):
            given = ", ".join(
                f"{name}={value}"
                for name, value in (
                    ("num_layers_in_first_pipeline_stage", first),
                    ("num_layers_in_last_pipeline_stage", last),
                )
                if value is not None
            )
            raise ValueError(
                f"GPTConfig.num_layers={config.num_layers}{' with ' + given if given else ''} does not split over "
                f"pipeline_model_parallel_size={pipeline_size}: the {others} other stage(s) would share "
                f"{remaining} layers unevenly; choose sizes that divide the layers, or set "
                "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
            )
        counts = [uneven.get(rank, remaining // max(others, 1)) for rank in range(pipeline_size)]
    for rank, count in enumerate(counts):
        if count < virtual_size or count % virtual_size:
            raise ValueError(
                f"Pipeline rank {rank} holds {count} layer(s) (num_layers={config.num_layers}, "
                f"pipeline_model_parallel_size={pipeline_size}), which do not split into "
                f"virtual_pipeline_model_parallel_size={virtual_size} stages of at least one layer; choose a "
                "virtual size dividing every rank's layers"
            )
    return counts


def stage_layouts(config: GPTConfig, pipeline_size: int, virtual_size: int = 1) -> list[StageLayout]:
    """Every stage of the model, in stage order (virtual stage v of rank r is stage v * P + r)."""
    counts = layers_per_rank(config, pipeline_size, virtual_size)
    num_stages = pipeline_size * virtual_size
    layouts, next_layer = [], 0
    for stage_index in range(num_stages):
        size = counts[stage_index % pipeline_size] // virtual_size
        layouts.append(StageLayout(stage_index, num_stages, tuple(range(next_layer, next_layer + size))))
        next_layer += size
    return layouts


def rank_stage_layouts(config: GPTConfig, pipeline_rank: int, pipeline_size: int, virtual_size: int = 1):
    """The stages pipeline rank `pipeline_rank` runs, in order."""
    return stage_layouts(config, pipeline_size, virtual_size)[pipeline_rank::pipeline_size]


def holds_tied_copy(config: GPTConfig, layouts: list[StageLayout]) -> bool:
    """Whether these stages hold a copy of the tied embedding weight for the output layer only (a last stage
    without the first)."""
    return (
        config.share_embeddings_and_output_weights
        and any(layout.post_process for layout in layouts)
        and not any(layout.pre_process for layout in layouts)
    )


def tied_output_copy(gpt: GPT) -> nn.Parameter | None:
    """The last stage's copy of the tied embedding weight (None where `gpt` holds no such copy)."""
    if gpt.config.share_embeddings_and_output_weights and gpt.post_process and not gpt.pre_process:
        return gpt.embedding.weight
    return None


def prune_to_stages(gpt: GPT, layouts: list[StageLayout]) -> None:
    """Drop from `gpt` (in place) the layers and end modules none of `layouts` runs."""
    keep = {index for layout in layouts for index in layout.layer_ids}
    for index in gpt.layers.indices():
        if index not in keep:
            del gpt.layers[str(index)]
    gpt.pre_process = any(layout.pre_process for layout in layouts)
    gpt.post_process = any(layout.post_process for layout in layouts)
    if not gpt.pre_process and not holds_tied_copy(gpt.config, layouts):
        gpt.embedding = None
    if not gpt.post_process:
        gpt.final_layernorm = None
        gpt.output_layer = None


def stage_module(gpt: GPT, layout: StageLayout) -> GPT:
    """A GPT running `layout`'s part of `gpt`, sharing its modules (so its parameters are `gpt`'s)."""
    shell = copy.copy(gpt.config)  # no layers of its own: `replace` would refuse num_layers=0 as a model's config
    shell.num_layers = 0
    with torch.device("meta"):
        stage = GPT(shell)
    stage.config = gpt.config
    stage.pre_process, stage.post_process = layout.pre_process, layout.post_process
    tied_output = layout.post_process and gpt.config.share_embeddings_and_output_weights
    stage.embedding = gpt.embedding if layout.pre_process or tied_output else None
    stage.layers = LayerDict({index: gpt.layers[index] for index in layout.layer_ids})
    stage.final_layernorm = gpt.final_layernorm if layout.post_process else None
    stage.output_layer = gpt.output_layer if layout.post_process else None
    if stage.embedding is not None and not layout.pre_process:
        stage.fsdp_unit_modules = (TransformerLayer,)  # the tied copy's forward never runs: shard it with the stage
    return stage


def split_gpt(gpt: GPT, pipeline_rank: int, pipeline_size: int, virtual_size: int = 1) -> list[tuple[int, GPT]]:
    """Prune `gpt` to pipeline rank `pipeline_rank`'s layers; return its stages as (stage index, module)."""
    layouts = rank_stage_layouts(gpt.config, pipeline_rank, pipeline_size, virtual_size)
    prune_to_stages(gpt, layouts)
    return [(layout.stage_index, stage_module(gpt, layout)) for layout in layouts]


def parallelize_gpt_stage(stage: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> GPT:
    """Apply the GPT's tensor (and sequence) parallel plan to the modules a pipeline stage holds.

    Hidden states between stages stay as each tp rank's local part (its sequence shard with
    `sequence_parallel`), so stages exchange them tp rank to tp rank.
    """
    validate_tensor_parallel(stage.config, tp_mesh.size(), sequence_parallel)
    plan = tensor_parallel_plan(stage.config, sequence_parallel)
    held = {name for name, module in stage.named_children() if module is not None}
    plan = {path: style for path, style in plan.items() if path.split(".")[0] in held}
    parallelize_module(stage, tp_mesh, plan)
    if stage.post_process and stage.config.share_embeddings_and_output_weights:
        parallelize_module(
            stage, tp_mesh, PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Replicate())
        )
    if sequence_parallel:
        stage.sequence_parallel_size = tp_mesh.size()
    return stage


def pack_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Labels and loss mask in one tensor [batch, 2, seq] (the pipeline schedules split one target tensor)."""
    mask = torch.ones_like(labels, dtype=torch.float64) if loss_mask is None else loss_mask.to(torch.float64)
    return torch.stack([labels.to(torch.float64), mask], dim=1)


def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A micro-batch's mean next-token loss over its unmasked tokens (`targets` from `pack_targets`)."""
    labels, loss_mask = targets[:, 0].long(), targets[:, 1].float()
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    return (losses * loss_mask.flatten()).sum() / loss_mask.sum().clamp(min=1.0)

"""`GPTModel`: the decoder as a LightningModule, like NeMo's `llm.GPTModel`."""

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from nemo_ckpt.checkpoint.context import IOMixin, set_init_arg
from nemo_ckpt.models.gpt.model import GPT, Attention, GPTConfig, with_vocab_of
from nemo_ckpt.models.gpt.moe import expert_parallel_group, moe_metrics
from nemo_ckpt.models.gpt.parallelize import parallelize_gpt
from nemo_ckpt.models.gpt.pipeline import (
    pack_targets,
    parallelize_gpt_stage,
    pipeline_loss,
    split_gpt,
    tied_output_copy,
)
from nemo_ckpt.optim import OptimizerConfig, clip_grad_norm
from nemo_ckpt.parallel.context_parallel import ContextParallel, GlobalPositions, token_mean, validate_sequence_length
from nemo_ckpt.parallel.expert_parallel import clip_grad_norm_expert_parallel
from nemo_ckpt.parallel.pipeline import clip_grad_norm_pipeline


class GPTModel(IOMixin, pl.LightningModule):
    """Next-token prediction with the model built in `configure_model` (so strategies may build it on `meta`).

    `peft` (e.g. `nemo_ckpt.peft.LoRA`): adapters added when the model is built; the base stays frozen, the
    optimizer sees the adapters only, and `state_dict` (so every checkpoint) holds only the adapters.
    """

    def __init__(self, config: GPTConfig, optim: OptimizerConfig | None = None, peft: Any = None) -> None:
        super().__init__()
        self.config = config
        self.optim = optim or OptimizerConfig()
        self.peft = peft
        self.module: GPT | None = None
        self.pipeline_stages: list[tuple[int, GPT]] = []  # this rank's stages, when split by split_pipeline
        self.pipeline_group: dist.ProcessGroup | None = None
        self.loss_group: dist.ProcessGroup | None = None  # loss sums reduced over it (parallelize_context)

    def use_vocabulary(self, data_vocab_size: int, source: str) -> None:
        """Size the vocabulary for data of `data_vocab_size` token ids (`with_vocab_of`), before the model is built;
        the stored config (`context/model.json`) records the size used."""
        config = with_vocab_of(self.config, data_vocab_size, source)
        if config is not self.config:
            set_init_arg(self, "config", config)

    def configure_model(self) -> None:
        if self.module is None:
            self.module = GPT(self.config)
            if self.peft is not None:
                self.peft.apply(self.module)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state = super().state_dict(*args, **kwargs)
        if self.peft is None:
            return state
        return type(state)((key, value) for key, value in state.items() if self.peft.is_adapter_key(key))

    def parallelize_tensor(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        """Apply the GPT's tensor (and sequence) parallel plan over `tp_mesh` (`nemo_ckpt.models.gpt.parallelize`)."""
        self.configure_model()
        if self.pipeline_stages:
            for _, stage in self.pipeline_stages:
                parallelize_gpt_stage(stage, tp_mesh, sequence_parallel)
            return
        parallelize_gpt(self.module, tp_mesh, sequence_parallel)

    def split_pipeline(self, pipeline_mesh: DeviceMesh, virtual_size: int) -> list[tuple[int, GPT]]:
        """Keep this pipeline rank's part of the GPT; return its stages (`nemo_ckpt.models.gpt.pipeline`)."""
        if self.peft is not None:
            raise ValueError(
                f"GPTModel(peft={type(self.peft).__name__}(...)) does not support pipeline parallelism yet; use "
                "pipeline_model_parallel_size=1"
            )
        self.configure_model()
        rank, size = pipeline_mesh.get_local_rank(), pipeline_mesh.size()
        self.pipeline_stages = split_gpt(self.module, rank, size, virtual_size)
        self.pipeline_group = pipeline_mesh.get_group()
        return self.pipeline_stages

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch as the pipeline's first-stage input and the last stage's loss target."""
        if "segment_ids" in batch:
            raise ValueError(
                "packed sequences (batches with segment_ids) are not supported with pipeline parallelism: use "
                "pipeline_model_parallel_size=1, or FineTuningDataModule(packed_sequence_specs=None)"
            )
        return batch["tokens"], pack_targets(batch["labels"], batch.get("loss_mask"))

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's loss of one micro-batch (of the whole sequences under context parallelism)."""
        if self.loss_group is None:
            return pipeline_loss(logits, targets)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets[:, 0].long().flatten(), reduction="none")
        return token_mean(losses, targets[:, 1].flatten().float(), self.loss_group)

    def pipeline_tied_weight(self) -> str | None:
        """The embedding weight, which the output layer shares (`share_embeddings_and_output_weights`)."""
        return "module.embedding.weight" if self.config.share_embeddings_and_output_weights else None

    def parallelize_context(
        self, cp_mesh: DeviceMesh, data_context_mesh: DeviceMesh, cp_comm_type: str, sequence_shards: int = 1
    ) -> None:
        """Split attention over the cp ranks of `cp_mesh` (`nemo_ckpt.parallel.context_parallel`) and reduce the
        loss over them (over `data_context_mesh` with `calculate_per_token_loss`); batches arrive split."""
        self.configure_model()
        cp_size = cp_mesh.size()
        if cp_size > 1:
            validate_sequence_length(self.config.seq_length, cp_size, sequence_shards)
            context_parallel = ContextParallel(cp_mesh.get_group(), cp_comm_type)
            for module in self.module.modules():
                if isinstance(module, Attention):
                    module.context_parallel = context_parallel
            for _, stage in self.pipeline_stages:  # the pipeline schedule passes a stage its input alone
                stage.register_forward_pre_hook(GlobalPositions(context_parallel, _stage_length), with_kwargs=True)
        if self.config.calculate_per_token_loss:
            self.loss_group = data_context_mesh.get_group()
        elif cp_size > 1:
            self.loss_group = cp_mesh.get_group()

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.module(tokens, position_ids, segment_ids)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean cross entropy over the (masked) tokens of the micro-batch, whose sequence may be split over cp
        ranks: then token sums and counts are summed over cp, so every cp rank returns the whole sequence's loss,
        and the all-reduce's backward scales each rank's gradient by cp, which the gradient average over dp x cp
        divides out again (Megatron's `loss * cp_size`). With `GPTConfig.calculate_per_token_loss`, the sums run
        over dp x cp: loss summed over all tokens of the step divided by the global token count, once."""
        logits = self(batch["tokens"], batch.get("position_ids"), batch.get("segment_ids"))
        if self.loss_group is None and "loss_mask" not in batch:
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        losses = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
        loss_mask = batch["loss_mask"].flatten().float() if "loss_mask" in batch else torch.ones_like(losses)
        if self.loss_group is None:
            return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)
        return token_mean(losses, loss_mask, self.loss_group)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("reduced_train_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["tokens"].shape[0])
        self.log("lr", self.lr_schedulers().get_last_lr()[0], batch_size=batch["tokens"].shape[0])
        for name, value in moe_metrics(self.module).items():  # aux losses, tokens per expert (MoE models)
            self.log(name, value, sync_dist=True, batch_size=batch["tokens"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["tokens"].shape[0])
        return loss

    def configure_optimizers(self):
        optimizer = self.optim.build_optimizer(param for param in self.parameters() if param.requires_grad)
        scheduler = self.optim.build_scheduler(optimizer, max(1, self.trainer.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if self.optim.clip_grad > 0:
            ep_group = expert_parallel_group(self)
            if self.pipeline_group is not None:  # each stage holds different layers: their norms add up
                grad_norm = clip_grad_norm_pipeline(
                    self.parameters(), self.optim.clip_grad, self.pipeline_group, tied_output_copy(self.module)
                )
            elif ep_group is None:
                grad_norm = clip_grad_norm(self.parameters(), self.optim.clip_grad)
            else:  # each rank holds different experts: their norms add up over the group
                grad_norm = clip_grad_norm_expert_parallel(self.named_parameters(), self.optim.clip_grad, ep_group)
            self.log("grad_norm", grad_norm, batch_size=1)


def _stage_length(stage: GPT, inputs: torch.Tensor) -> int:
    """The sequence length a pipeline stage runs on: its input's, times the sequence-parallel split of hidden states."""
    return inputs.shape[1] * (1 if stage.pre_process else stage.sequence_parallel_size)

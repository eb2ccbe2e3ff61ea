"""`GPTModel`: the decoder as a LightningModule, like NeMo's `llm.GPTModel`."""

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from nemo_ckpt.checkpoint.context import IOMixin
from nemo_ckpt.models.gpt.model import GPT, GPTConfig
from nemo_ckpt.models.gpt.parallelize import parallelize_gpt
from nemo_ckpt.optim import OptimizerConfig, clip_grad_norm


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
        if self.peft is not None:
            raise ValueError(
                f"GPTModel(peft={type(self.peft).__name__}(...)) does not support tensor parallelism yet; use "
                "tensor_model_parallel_size=1 with DDP or FSDP2"
            )
        self.configure_model()
        parallelize_gpt(self.module, tp_mesh, sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(tokens)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self(batch["tokens"])
        if "loss_mask" not in batch:
            return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        losses = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
        loss_mask = batch["loss_mask"].flatten().float()
        return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("reduced_train_loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["tokens"].shape[0])
        self.log("lr", self.lr_schedulers().get_last_lr()[0], batch_size=batch["tokens"].shape[0])
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
            grad_norm = clip_grad_norm(self.parameters(), self.optim.clip_grad)
            self.log("grad_norm", grad_norm, batch_size=1)

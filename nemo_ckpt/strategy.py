"""`MegatronStrategy`: NeMo's Lightning strategy on plain PyTorch, saving through `dist_checkpointing`."""

from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer

from nemo_ckpt.checkpoint_io import DistCheckpointIO
from nemo_ckpt.sharding import optimizer_sharded_state_dict, replicated_sharded_state_dict


class MegatronStrategy(DDPStrategy):
    """Data-parallel training (gloo on CPU, NCCL on GPU) with sharded, reshardable checkpoints on every rank."""

    def __init__(
        self,
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
        **ddp_kwargs: Any,
    ) -> None:
        checkpoint_io = DistCheckpointIO(
            save_ckpt_format=save_ckpt_format,
            async_save=ckpt_async_save,
            parallel_save=ckpt_parallel_save,
            parallel_save_within_dp=ckpt_parallel_save_within_dp,
            parallel_load=ckpt_parallel_load,
            torch_dist_multiproc=ckpt_torch_dist_multiproc,
            assume_constant_structure=ckpt_assume_constant_structure,
            parallel_save_optim=ckpt_parallel_save_optim,
            load_directly_on_device=ckpt_load_directly_on_device,
            load_strictness=ckpt_load_strictness,
        )
        super().__init__(checkpoint_io=checkpoint_io, **ddp_kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any) -> None:
        self.checkpoint_io.maybe_finalize(blocking=False)  # complete async saves that have been written
        super().on_train_batch_start(batch, batch_idx, *args)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return replicated_sharded_state_dict(self.lightning_module.state_dict(), replica_id=self.global_rank)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        optim_state = get_optimizer_state_dict(self.lightning_module, optimizer)
        return optimizer_sharded_state_dict(optim_state, self.lightning_module_state_dict())

    def sharded_state_dict(self) -> dict[str, Any]:
        """The template a checkpoint is loaded into: model and optimizer entries, as in a saved checkpoint."""
        return {
            "state_dict": self.lightning_module_state_dict(),
            "optimizer_states": [self.optimizer_state(optimizer) for optimizer in self.optimizers],
        }

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(checkpoint_path, sharded_state_dict=self.sharded_state_dict())

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, optim_state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            set_optimizer_state_dict(self.lightning_module, optimizer, optim_state)

    def remove_checkpoint(self, filepath: str | Path) -> None:
        self.barrier("remove_checkpoint")
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

"""`DistCheckpointIO`: Lightning's CheckpointIO on `nemo_ckpt.dist_checkpointing`."""

import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from nemo_ckpt import dist_checkpointing

WEIGHTS_DIR = "weights"


def weights_dir(checkpoint_path: str | Path) -> Path:
    """The distributed checkpoint inside a training checkpoint directory."""
    return Path(checkpoint_path) / WEIGHTS_DIR


class DistCheckpointIO(CheckpointIO):
    """Saves a sharded checkpoint dict on every rank into `<path>/weights`, loads it back into a template."""

    def __init__(self, save_ckpt_format: str = "torch_dist", async_save: bool = False, parallel_save: bool = False,
                 parallel_save_within_dp: bool = False, parallel_load: bool = False,
                 torch_dist_multiproc: int | None = None, assume_constant_structure: bool = False,
                 parallel_save_optim: bool = False, load_directly_on_device: bool = False,
                 load_strictness: str | None = None) -> None:
        not_yet = {"ckpt_async_save": async_save, "ckpt_parallel_save": parallel_save,
                   "ckpt_parallel_save_within_dp": parallel_save_within_dp, "ckpt_parallel_load": parallel_load,
                   "ckpt_torch_dist_multiproc": torch_dist_multiproc,
                   "ckpt_assume_constant_structure": assume_constant_structure,
                   "ckpt_parallel_save_optim": parallel_save_optim,
                   "ckpt_load_directly_on_device": load_directly_on_device}
        enabled = [name for name, value in not_yet.items() if value]
        if enabled:
            raise NotImplementedError(f"MegatronStrategy options {enabled} are not implemented yet; leave them unset")
        if save_ckpt_format != "torch_dist":
            raise ValueError(f"MegatronStrategy(save_ckpt_format={save_ckpt_format!r}): only 'torch_dist' is supported")
        self.save_ckpt_format = save_ckpt_format
        self.load_strictness = load_strictness

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Collective save. `storage_options={"finalize_fn": fn}`: `fn()` runs on every rank, in save order,
        once the checkpoint is complete on all ranks."""
        target = weights_dir(path)
        target.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(checkpoint, target, sharded_strategy=(self.save_ckpt_format, 1))
        finalize_fn = (storage_options or {}).get("finalize_fn")
        if finalize_fn is not None:
            finalize_fn()

    def load_checkpoint(self, path: str | Path, map_location: Any = None,
                        sharded_state_dict: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        if sharded_state_dict is None:
            raise ValueError("DistCheckpointIO.load_checkpoint needs `sharded_state_dict`, the template to load into")
        source = weights_dir(path)
        if self.load_strictness is None:
            return dist_checkpointing.load(sharded_state_dict, source)
        return dist_checkpointing.load(sharded_state_dict, source, strict=self.load_strictness)

    def remove_checkpoint(self, path: str | Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

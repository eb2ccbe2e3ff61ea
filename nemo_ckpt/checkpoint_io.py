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

    def __init__(self, save_ckpt_format: str = "torch_dist", load_strictness: str | None = None) -> None:
        self.save_ckpt_format = save_ckpt_format
        self.load_strictness = load_strictness

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        target = weights_dir(path)
        target.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(checkpoint, target, sharded_strategy=(self.save_ckpt_format, 1))

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

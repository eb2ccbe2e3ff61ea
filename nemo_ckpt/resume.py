"""`AutoResume`: pick the checkpoint a run continues from, like NeMo's `nl.AutoResume`."""

import logging
from dataclasses import dataclass
from pathlib import Path

from nemo_ckpt.checkpoint_io import weights_dir
from nemo_ckpt.manifest import Manifest

log = logging.getLogger(__name__)


def is_complete(checkpoint: Path) -> bool:
    """A checkpoint is complete once its `metadata.json` is written, which happens last."""
    return (weights_dir(checkpoint) / "metadata.json").is_file()


@dataclass
class AutoResume:
    """`resume_from_path` wins; else, with `resume_if_exists`, the newest complete checkpoint in
    `resume_from_directory` (default: the run's checkpoint directory)."""

    resume_if_exists: bool = False
    resume_ignore_no_checkpoint: bool = False
    resume_from_path: str | None = None
    resume_from_directory: str | None = None

    def find_checkpoint(self, checkpoint_dir: str | Path | None) -> Path | None:
        if self.resume_from_path:
            path = Path(self.resume_from_path)
            if not is_complete(path):
                raise FileNotFoundError(f"AutoResume(resume_from_path={str(path)!r}) is not a complete checkpoint: "
                                        f"{weights_dir(path) / 'metadata.json'} is missing")
            return path
        if not self.resume_if_exists:
            return None
        directory = Path(self.resume_from_directory or checkpoint_dir or "")
        for record in sorted(Manifest.read(directory).checkpoints, key=lambda r: r.step, reverse=True):
            if is_complete(directory / record.name):
                return directory / record.name
            log.warning("Skipping incomplete checkpoint %s", directory / record.name)
        if self.resume_ignore_no_checkpoint:
            log.info("No checkpoint in %s; starting from scratch", directory)
            return None
        raise FileNotFoundError(f"AutoResume(resume_if_exists=True) found no complete checkpoint in {directory}; "
                                "set resume_ignore_no_checkpoint=True to start from scratch")

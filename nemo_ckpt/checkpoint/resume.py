"""`AutoResume`: pick the checkpoint a run continues from, like NeMo's `nl.AutoResume`."""

import logging
from dataclasses import dataclass
from pathlib import Path

import fiddle as fdl
import lightning.pytorch as pl

from nemo_ckpt.checkpoint import context
from nemo_ckpt.checkpoint.layout import MANIFEST_NAME, completion_marker, is_complete
from nemo_ckpt.checkpoint.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass
class AutoResume:
    """Where a run resumes from.

    `resume_from_path` (a checkpoint) wins. Else, with `resume_if_exists`, the newest complete checkpoint that
    holds optimizer state in `resume_from_directory` (default: the run's checkpoint directory), found through
    its `checkpoints.json`: unfinished and incomplete checkpoints are skipped with a warning. Without one, the
    run fails unless `resume_ignore_no_checkpoint`. With `restore_config`, the model is rebuilt from the config
    stored in the checkpoint instead of the one the run was given.
    """

    resume_if_exists: bool = False
    resume_ignore_no_checkpoint: bool = False
    resume_from_path: str | None = None
    resume_from_directory: str | None = None
    restore_config: bool = False

    def find_checkpoint(self, checkpoint_dir: str | Path | None) -> Path | None:
        """The checkpoint to resume from, or None to start from scratch."""
        if self.resume_from_path:
            path = Path(self.resume_from_path)
            if not is_complete(path):
                raise FileNotFoundError(
                    f"AutoResume(resume_from_path={str(path)!r}) is not a complete checkpoint: "
                    f"{completion_marker(path)} is missing"
                )
            return path
        if not self.resume_if_exists:
            return None
        if self.resume_from_directory is None and checkpoint_dir is None:
            raise ValueError(
                "AutoResume(resume_if_exists=True) needs resume_from_directory or the run's checkpoint directory"
            )
        directory = Path(self.resume_from_directory or checkpoint_dir)
        checkpoint = newest_resumable(directory)
        if checkpoint is not None:
            log.info("AutoResume: resuming from %s", checkpoint)
            return checkpoint
        if self.resume_ignore_no_checkpoint:
            log.info("AutoResume: no checkpoint to resume from in %s; starting from scratch", directory)
            return None
        hint = ""
        if (
            directory.is_dir()
            and not (directory / MANIFEST_NAME).exists()
            and any(is_complete(entry) for entry in directory.iterdir())
        ):
            hint = f" ({MANIFEST_NAME} is missing: pass one of its checkpoints as resume_from_path)"
        raise FileNotFoundError(
            f"AutoResume(resume_if_exists=True) found no complete checkpoint in {directory}{hint}; "
            "set resume_ignore_no_checkpoint=True to start from scratch"
        )

    def restore_model(self, checkpoint: Path | None, model: pl.LightningModule) -> pl.LightningModule:
        """With `restore_config` and a checkpoint, the model rebuilt from the checkpoint's config; else `model`."""
        if not self.restore_config or checkpoint is None:
            return model
        config = context.load_context(checkpoint, "model")
        if isinstance(model, context.IOMixin) and model.__io__ != config:
            log.warning(
                "AutoResume(restore_config=True): using the model config of %s, not the one given:\n%s",
                checkpoint,
                config,
            )
        return fdl.build(config)


def newest_resumable(directory: Path) -> Path | None:
    """The newest complete checkpoint in `directory` that holds optimizer state, from its manifest."""
    for record in reversed(Manifest.read(directory).checkpoints):
        path = directory / record.name
        if record.state == "deleting":
            continue
        if not is_complete(path):
            log.warning(
                "AutoResume: skipping %s: %s",
                path,
                "its save did not finish" if record.state == "saving" else "it is missing or incomplete",
            )
        elif record.weights_only:
            log.info("AutoResume: skipping %s: it holds no optimizer state (save_optim_on_train_end=False)", path)
        else:
            return path
    return None

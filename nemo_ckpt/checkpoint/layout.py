"""Every name of the on-disk checkpoint layout, in one place.

<checkpoint dir>/                    e.g. nemo_experiments/<name>/checkpoints
    checkpoints.json                 the manifest: every checkpoint and its state (manifest.py)
    <name>/                          one checkpoint, visible only once complete
        weights/                     the distributed checkpoint (nemo_ckpt.dist_checkpointing)
            metadata.json            written last: the checkpoint is complete once it exists
        context/<model|data>.json    the Fiddle configs its model and data were built from
        context/hf/                  its tokenizer as Hugging Face files (tokenizer.json or tokenizer.model,
                                     tokenizer_config.json); an imported model's config.json too
    <name>-last -> <name>            symlink to the newest checkpoint
    .tmp-<name>/                     a save in progress (or a link being replaced)
    .trash-<name>/                   a deletion in progress
    .writer.lock                     held (flock) by the run writing here; records its host, pid, Slurm job
"""

from pathlib import Path

from nemo_ckpt.dist_checkpointing.core import CONFIG_FNAME

MANIFEST_NAME = "checkpoints.json"
WEIGHTS_DIR = "weights"
CONTEXT_DIR = "context"
HF_ARTIFACTS_DIR = "hf"
LAST_SUFFIX = "-last"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LOCK_NAME = ".writer.lock"


def weights_dir(checkpoint: str | Path) -> Path:
    """The distributed checkpoint inside a training checkpoint directory."""
    return Path(checkpoint) / WEIGHTS_DIR


def context_dir(checkpoint: str | Path) -> Path:
    """The stored configs inside a training checkpoint directory."""
    return Path(checkpoint) / CONTEXT_DIR


def hf_artifacts_dir(checkpoint: str | Path) -> Path:
    """The checkpoint's tokenizer as Hugging Face files, and an imported model's config.json and generation config."""
    return context_dir(checkpoint) / HF_ARTIFACTS_DIR


def completion_marker(checkpoint: str | Path) -> Path:
    """The file written last by a save: `weights/metadata.json`."""
    return weights_dir(checkpoint) / CONFIG_FNAME


def is_complete(checkpoint: str | Path) -> bool:
    """A checkpoint is complete once its `weights/metadata.json` is written, which happens last."""
    return completion_marker(checkpoint).is_file()

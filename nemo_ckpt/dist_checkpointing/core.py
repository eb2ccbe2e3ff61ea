"""Checkpoint-level metadata: `metadata.json`, the base exception, durable writes."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """Base checkpointing related exception."""


@dataclass
class CheckpointingConfig:
    """Backends (and their format versions) a checkpoint was written with."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def check_is_distributed_checkpoint(checkpoint_dir: str | Path) -> bool:
    """True if `checkpoint_dir` holds a valid `metadata.json`."""
    try:
        return maybe_load_config(checkpoint_dir) is not None
    except CheckpointingException:
        return False


def maybe_load_config(checkpoint_dir: str | Path) -> CheckpointingConfig | None:
    """The checkpoint config, or None when `checkpoint_dir` has no `metadata.json`.

    Raises CheckpointingException when the file exists but is not a valid config.
    """
    config_path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    if not os.path.isfile(config_path):
        return None
    try:
        with open(config_path) as f:
            config_dict = json.load(f)
        known = {f.name for f in dataclasses.fields(CheckpointingConfig)}
        return CheckpointingConfig(**{k: v for k, v in config_dict.items() if k in known})
    except (ValueError, TypeError) as e:
        raise CheckpointingException(f"{config_path} is not a valid checkpoint config: {e}") from e


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Create `path` with `write(file)`, and flush it to the disk before returning."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_config(config: CheckpointingConfig, checkpoint_dir: str | Path) -> None:
    """Write `metadata.json` atomically (a crash leaves either no file or a complete one) and durably (fsynced,
    with its directory, so a power loss cannot leave an empty file)."""
    config_path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    tmp_path = config_path + ".tmp"
    write_durably(tmp_path, lambda f: f.write(json.dumps(dataclasses.asdict(config)).encode()))
    os.replace(tmp_path, config_path)
    fsync_path(checkpoint_dir)

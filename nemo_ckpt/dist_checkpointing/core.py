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
    with open(config_path, "rb") as f:
        return parse_config(f.read(), config_path)


def parse_config(data: bytes, config_path: str | Path) -> CheckpointingConfig:
    """The checkpoint config stored as `data` in `config_path`; CheckpointingException if it is not one."""
    try:
        config_dict = json.loads(data)
        if not isinstance(config_dict, dict):
            raise TypeError(f"a JSON {type(config_dict).__name__}, not an object")
        known = {f.name for f in dataclasses.fields(CheckpointingConfig)}
        config = CheckpointingConfig(**{k: v for k, v in config_dict.items() if k in known})
        for field in dataclasses.fields(config):
            value = getattr(config, field.name)
            expected = int if field.name.endswith("version") else str
            if type(value) is not expected:
                raise TypeError(f"{field.name}={value!r} is not a {expected.__name__}")
        return config
    except (ValueError, TypeError) as e:
        raise CheckpointingException(f"{config_path} is not a valid checkpoint config: {e}") from e


def config_document(config: CheckpointingConfig) -> bytes:
    """The content of `metadata.json` for `config`."""
    return json.dumps(dataclasses.asdict(config)).encode()


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
    write_durably(tmp_path, lambda f: f.write(config_document(config)))
    os.replace(tmp_path, config_path)
    fsync_path(checkpoint_dir)

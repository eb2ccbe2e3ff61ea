"""Index arrays cached on disk, keyed by a hash of what they depend on, built once by rank 0 while others wait."""

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist


def description_hash(description: dict[str, Any]) -> tuple[str, str]:
    """The description as stable JSON, and its md5 (the cache key, as Megatron-Core names its index files)."""
    text = json.dumps(description, indent=4, sort_keys=True)
    return text, hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def load_or_build(
    cache_dir: str | Path | None,
    base: str,
    description: dict[str, Any],
    names: Sequence[str],
    build: Callable[[], Sequence[np.ndarray]],
) -> list[np.ndarray]:
    """Arrays `names` of `build()`, cached as `<cache_dir>/<hash>-<base>-<name>.npy` (memory-mapped when loaded).

    Under torch.distributed every rank must call this in the same order: rank 0 builds and writes (each file under a
    temporary name, then renamed), the others wait at a barrier and load. Without `cache_dir` every rank builds.
    """
    if cache_dir is None:
        return list(build())
    text, digest = description_hash(description)
    directory = Path(cache_dir)
    paths = [directory / f"{digest}-{base}-{name}.npy" for name in names]
    description_path = directory / f"{digest}-{base}-description.txt"
    distributed = dist.is_available() and dist.is_initialized()
    hit = description_path.is_file() and all(path.is_file() for path in paths)
    if not hit and (not distributed or dist.get_rank() == 0):
        arrays = list(build())
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for path, array in zip(paths, arrays):
                _write_atomically(path, lambda handle, array=array: np.save(handle, array, allow_pickle=False))
            _write_atomically(description_path, lambda handle: handle.write(text.encode("utf-8")))
        except OSError as error:
            raise OSError(
                f"Cannot write the {base} index files to {directory} ({error}); point the cache to a writable "
                "directory: PreTrainingDataModule(index_mapping_dir=...) or GPTDatasetConfig(path_to_cache=...)"
            ) from error
    if distributed:
        dist.barrier()
    # plain ndarray views of the memory maps: indexing them is several times cheaper than indexing np.memmap
    return [np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray) for path in paths]


def _write_atomically(path: Path, write: Callable) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()

"""Convert a legacy zarr checkpoint to torch_dist (one process; every tensor is loaded whole).

python -m nemo_ckpt.dist_checkpointing.converter ZARR_CHECKPOINT_DIR TORCH_DIST_CHECKPOINT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .core import CheckpointingException, maybe_load_config
from .mapping import ShardedObject, ShardedTensor
from .serialization import load, save
from .strategies.common import TorchCommonLoadStrategy
from .strategies.torch import TorchDistSaveShardedStrategy
from .strategies.zarr import ZarrLoadShardedStrategy

CONVERTED_KEY = "_converted_from_zarr"


def convert_zarr_to_torch_dist(source: str | Path, target: str | Path, thread_count: int = 1) -> None:
    """Write the tensors, ShardedObjects and common state of the zarr checkpoint `source` as a torch_dist
    checkpoint in `target` (created if missing). Loading either gives the same state dict."""
    source, target = Path(source), Path(target)
    config = maybe_load_config(source)
    if config is None or config.sharded_backend != "zarr":
        found = "no metadata.json" if config is None else f"backend {config.sharded_backend!r}"
        raise CheckpointingException(f"{source} is not a zarr checkpoint ({found}); nothing to convert")
    zarr_strategy = ZarrLoadShardedStrategy()
    tensors = zarr_strategy.load_tensors_metadata(source)
    objects = TorchCommonLoadStrategy().load_sharded_metadata(source)
    template = {CONVERTED_KEY: {**tensors, **objects}}
    loaded = load(template, source, sharded_strategy=zarr_strategy, validate_access_integrity=False)
    converted = loaded.pop(CONVERTED_KEY)
    sharded: dict = {}
    for key, value in converted.items():
        if key in tensors:
            sharded[key] = ShardedTensor.from_rank_offsets(key, value)
        else:
            meta = objects[key]
            sharded[key] = ShardedObject(meta.key, value, meta.global_shape, meta.global_offset)
    target.mkdir(parents=True, exist_ok=True)
    save({**loaded, CONVERTED_KEY: sharded}, target, TorchDistSaveShardedStrategy(thread_count=thread_count))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="zarr checkpoint directory (with metadata.json)")
    parser.add_argument("target", help="torch_dist checkpoint directory to write")
    args = parser.parse_args(argv)
    convert_zarr_to_torch_dist(args.source, args.target)


if __name__ == "__main__":
    main()

"""`python -m nemo_ckpt inspect|consolidate|verify`: look into, flatten and check distributed checkpoints.

Each takes a `dist_checkpointing` directory or a training checkpoint (whose `weights/` directory it finds; `verify`
checks its `context/` too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from .core import CheckpointingException, maybe_load_config
from .integrity import Corruption, check_directory, print_progress, verify_checkpoint, written_with_checksums
from .serialization import load, load_common_state_dict, load_tensors_metadata
from .strategies.torch import SafeFileSystemReader
from .validation import verify_checkpoint_and_load_strategy

OPTIMIZER_PREFIX = "optimizer."  # Megatron-Core's and NeMo's optimizer state keys; every other tensor is the model's
TORCH_METADATA = ".metadata"
CONTEXT_DIR = "context"  # a training checkpoint's stored configs, beside `weights/`


def weights_directory(checkpoint: str | Path) -> Path:
    """`checkpoint`'s `weights/` directory if it is a training checkpoint, else `checkpoint` itself."""
    directory = Path(checkpoint)
    return directory / "weights" if (directory / "weights").is_dir() else directory


def describe(checkpoint_dir: str | Path, allow_unsafe_pickle: bool = False) -> dict[str, Any]:
    """Backend config, tensors (shape, dtype, bytes, chunks), objects (bytes) and common keys."""
    verify_checkpoint_and_load_strategy(checkpoint_dir)
    config = maybe_load_config(checkpoint_dir)
    metadata = SafeFileSystemReader(checkpoint_dir, allow_unsafe_pickle).read_metadata()
    stored_bytes: dict[str, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        stored_bytes[index.fqn] += info.length
    tensors, objects = {}, {}
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for s in md.size:
                numel *= s
            tensors[key] = {
                "shape": list(md.size),
                "dtype": str(md.properties.dtype).replace("torch.", ""),
                "bytes": numel * md.properties.dtype.itemsize,
                "chunks": len(md.chunks),
            }
        elif isinstance(md, BytesStorageMetadata):
            objects[key] = {"bytes": stored_bytes[key]}
    try:
        common: Any = sorted(map(str, load_common_state_dict(checkpoint_dir, allow_unsafe_pickle)))
    except CheckpointingException as e:
        common = f"<not loaded: {e}>"
    files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".distcp"))
    return {
        "backend": dataclasses.asdict(config),
        "tensors": tensors,
        "objects": objects,
        "common_keys": common,
        "total_tensor_bytes": sum(t["bytes"] for t in tensors.values()),
        "files": files,
    }


def _print_description(info: dict[str, Any]) -> None:
    b = info["backend"]
    sharded = f"{b['sharded_backend']} v{b['sharded_backend_version']}"
    print(f"backend: {sharded} (common: {b['common_backend']} v{b['common_backend_version']})")
    print(f"files: {len(info['files'])} .distcp")
    width = max([len(k) for k in info["tensors"]] + [3])
    print(f"{'key':<{width}}  {'shape':<20} {'dtype':<10} {'bytes':>12} chunks")
    for key, t in info["tensors"].items():
        print(f"{key:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']:<10} {t['bytes']:>12} {t['chunks']}")
    for key, o in info["objects"].items():
        print(f"{key:<{width}}  {'object':<20} {'':<10} {o['bytes']:>12}")
    print(f"total tensor bytes: {info['total_tensor_bytes']}")
    print(f"common keys: {info['common_keys']}")


def consolidate(
    checkpoint_dir: str | Path, out_path: str, fmt: str | None = None, weights_only: bool = False
) -> dict[str, torch.Tensor]:
    """Write every tensor, whole, to one file: torch (`torch.save` of `{key: tensor}`) or safetensors (chosen by
    `fmt` or an `.safetensors` suffix). `weights_only`: the model's tensors only, without the optimizer state
    (keys `optimizer.*`, which are not read). The file gets the mode `open()` gives (0644 under umask 022)."""
    metadata = load_tensors_metadata(checkpoint_dir)
    keys = [key for key in metadata if not (weights_only and key.startswith(OPTIMIZER_PREFIX))]
    loaded = load({key: metadata[key] for key in keys}, checkpoint_dir, validate_access_integrity=False)
    tensors = {key: loaded[key] for key in keys}
    fmt = fmt or ("safetensors" if out_path.endswith(".safetensors") else "torch")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        with open(out_path, "wb"):  # the mode a new file gets here: safetensors renames a 0600 file into place
            mode = stat.S_IMODE(os.stat(out_path).st_mode)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            out_path,
            metadata={"source": os.path.abspath(checkpoint_dir)},
        )
        os.chmod(out_path, mode)
    else:
        torch.save(tensors, out_path)
    return tensors


def verify(checkpoint: str, threads: int = 4) -> int:
    """Print each corrupt range of `checkpoint` (and of a training checkpoint's `context/`); 0 if intact, 1 if
    corrupt, not a checkpoint, or saved with checksums that are missing now, 2 if it holds no checksums (a
    checkpoint of Megatron-Core, NeMo or another tool)."""
    check_directory(checkpoint)
    directory = weights_directory(checkpoint)
    corruptions = verify_checkpoint(directory, threads, print_progress)
    if corruptions is None:
        if maybe_load_config(directory) is None and not (directory / TORCH_METADATA).is_file():
            raise CheckpointingException(
                f"{directory} is not a distributed checkpoint: it holds no metadata.json or {TORCH_METADATA}"
            )
        print(f"{directory}: no checksums stored (saved by Megatron-Core, NeMo or another tool): nothing to verify")
        return 2
    found: list[tuple[Path, Corruption]] = [(directory, corruption) for corruption in corruptions]
    context = Path(checkpoint) / CONTEXT_DIR
    if directory != Path(checkpoint) and context.is_dir():
        required = written_with_checksums(directory)
        found += [(context, c) for c in verify_checkpoint(context, threads, print_progress, required) or []]
    for where, corruption in found:
        print(f"CORRUPT {where / corruption.file}: bytes [{corruption.start}, {corruption.stop}): {corruption.reason}")
    print(f"{checkpoint}: {'corrupt' if found else 'intact'} ({len(found)} corrupt ranges)")
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_ckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="list keys, shapes, dtypes, bytes and backend")
    p_inspect.add_argument("checkpoint")
    p_inspect.add_argument("--json", action="store_true", help="print JSON")
    p_inspect.add_argument("--allow-unsafe-pickle", action="store_true", help="trust the checkpoint's pickles")
    p_cons = sub.add_parser("consolidate", help="write all tensors, unsharded, to one file")
    p_cons.add_argument("checkpoint")
    p_cons.add_argument("out")
    p_cons.add_argument("--format", choices=["torch", "safetensors"], default=None)
    p_cons.add_argument(
        "--weights-only", action="store_true", help="the model's weights only, without the optimizer state"
    )
    p_verify = sub.add_parser("verify", help="check every file against the checksums stored at save")
    p_verify.add_argument("checkpoint", help="a checkpoint (its weights/ directory is found) or weights directory")
    p_verify.add_argument("--threads", type=int, default=4, help="files checked in parallel")
    args = parser.parse_args(argv)
    try:
        if args.command == "verify":
            return verify(args.checkpoint, args.threads)
        if args.command == "inspect":
            info = describe(weights_directory(args.checkpoint), args.allow_unsafe_pickle)
            print(json.dumps(info, indent=2)) if args.json else _print_description(info)
        else:
            tensors = consolidate(weights_directory(args.checkpoint), args.out, args.format, args.weights_only)
            print(f"wrote {len(tensors)} tensors to {args.out}")
    except CheckpointingException as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0

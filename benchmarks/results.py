"""What the benchmark scripts share: their dependency check, and benchmarks/RESULTS.md, where each script owns one
`## ...` section and rewrites only that one."""

import importlib.util
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str, path: Path = RESULTS) -> None:
    """Replace the section headed by `section`'s first line, or append it; the other sections stay as they are."""
    heading = section.splitlines()[0]
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n\n", text).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


MEGATRON_CORE_INSTALL = "bash tests/install_megatron_core.sh .venv, then run with PYTHONPATH=.venv/megatron-core-0.19.2"


def check_dependencies(
    required: list[str], peers: dict[str, str] | None = None, programs: list[str] | None = None
) -> None:
    """At start, not minutes in: exit naming the install command if a required module (or program on PATH) is
    missing; say which optional peers (module -> how to install it) are not importable and will be left out of
    the comparison."""
    script = Path(sys.argv[0]).name
    missing = [name for name in required if importlib.util.find_spec(name) is None]
    if missing:
        needed = ", ".join(missing)
        sys.exit(f"{script} needs {needed}: pip install -c constraints.txt -e '.[bench]' from the repository root")
    absent = [name for name in programs or [] if shutil.which(name) is None]
    if absent:
        sys.exit(f"{script} needs the program(s) {', '.join(absent)} on PATH (coreutils)")
    for name, install in (peers or {}).items():
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            print(f"{script}: {name} is not importable, so it is left out of the comparison ({install})")


def free_port() -> int:
    """A free TCP port on the loopback interface, for a benchmark's process group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_process_group(rank: int, world: int, port: int, threads: int = 1, backend: str = "gloo") -> None:
    """Join a benchmark's process group on this machine as torchrun would start the rank (`threads` per rank)."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world)


def gpu_ranks_error(ranks: list[int], device: str) -> str | None:
    """The command-line error for `--device cuda` with more ranks than this machine has GPUs (one per rank), or
    None."""
    import torch

    if device != "cuda" or max(ranks) <= torch.cuda.device_count():
        return None
    return (
        f"--device cuda --ranks {' '.join(map(str, ranks))}: one GPU per rank, and this machine has "
        f"{torch.cuda.device_count()}; use --ranks up to that, or --device cpu"
    )


def measurement_trainer(devices: int, strategy: Any, max_steps: int, callbacks: list, accelerator: str = "cpu") -> Any:
    """A Lightning Trainer that only trains: no logger, checkpoints, progress bar, summary or validation."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def settled() -> float:
    """`time.perf_counter()` once the current CUDA stream has done the work queued on it so far, where CUDA is in
    use (work on other streams, e.g. a save's copies into host memory, only where the stream waits for it)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()

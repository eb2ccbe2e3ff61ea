"""Test-only pause points in the checkpoint path, so that a test SIGKILLs a process at a named moment of a save, a
load or a recovery by construction instead of by timing.

Off unless the environment variable `NEMO_CKPT_PAUSE_AT` names a point: `<point>` pauses the first time this process
reaches it, `<point>@<n>` the n-th time (each point is reached once per save, load or recovery by each process that
reaches it, so `@n` is the n-th save of the process). The process writes the file `NEMO_CKPT_PAUSE_MARKER` (the point
and its pid) when it pauses, then blocks until it is killed; a paused process whose parent ends exits (a paused
writer process does not outlive its rank). The variables are read at each point, so a process may set them after it
imported the package (a forked test rank); unset, a point costs one environment lookup.

The points, and who reaches them:

- `distcp-written`: a rank's first `.distcp` file of a save is written and fsynced (every rank, in the file's writer
  thread: the training process's for a sync save, the background writer's or the writer process's for an async one);
- `async-write-done`: an async save's background write is done on this rank and the save not finalized yet (every
  rank, the background writer thread; training goes on, and waits at its next save);
- `before-dcp-metadata`: every rank's files are written, DCP's `.metadata` not yet (rank 0);
- `before-metadata-json`: `.metadata` and `checksums.json` written, `metadata.json` (the completeness marker) not yet
  (rank 0);
- `before-commit-rename`: the checkpoint is complete as `.tmp-<name>`, before the rename that publishes it (rank 0);
- `before-manifest-commit`: renamed to `<name>`, before `checkpoints.json` records it complete (rank 0);
- `restore-read`: a load has read its tensors, before it returns them (every rank);
- `recover`: `ModelCheckpoint.recover` at start-up has removed what a crash left half-written, before it rewrites
  `checkpoints.json` (rank 0).
"""

import os
import threading
import time

PAUSE_AT = "NEMO_CKPT_PAUSE_AT"
PAUSE_MARKER = "NEMO_CKPT_PAUSE_MARKER"
POINTS = frozenset(
    {
        "distcp-written",
        "async-write-done",
        "before-dcp-metadata",
        "before-metadata-json",
        "before-commit-rename",
        "before-manifest-commit",
        "restore-read",
        "recover",
    }
)

_reached: dict[str, int] = {}
_lock = threading.Lock()


def pause_point(name: str) -> None:
    """Pause here if `NEMO_CKPT_PAUSE_AT` names this point and reach (see the module's doc)."""
    armed = os.environ.get(PAUSE_AT)
    if armed is not None:
        _pause_if_due(name, armed)


def _pause_if_due(name: str, armed: str) -> None:
    point, _, nth = armed.partition("@")
    if point not in POINTS or not (nth or "1").isdigit():
        raise ValueError(f"{PAUSE_AT}={armed!r}: use <point> or <point>@<n>, a point one of {sorted(POINTS)}")
    if point != name:
        return
    with _lock:
        _reached[name] = reached = _reached.get(name, 0) + 1
    if reached < int(nth or 1):
        return
    marker = os.environ.get(PAUSE_MARKER)
    if not marker:
        raise ValueError(f"{PAUSE_AT}={armed!r} needs {PAUSE_MARKER}, the file that signals the pause")
    tmp = f"{marker}.{os.getpid()}.{threading.get_native_id()}.tmp"
    with open(tmp, "w") as handle:
        handle.write(f"{name} {os.getpid()}\n")
    os.replace(tmp, marker)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.1)
    os._exit(1)

"""One writer per checkpoint directory: `DirectoryLock`, an exclusive `flock` on `<dir>/.writer.lock`.

The lock lives as long as the file descriptor that holds it: the OS releases it when the holding process ends, so a
run killed with SIGKILL leaves no stale lock. The file records who holds it (host, process, Slurm job, start time),
which a second run on the same directory is refused with (`DirectoryLockedError`). On network file systems
`flock` needs the file system's lock support (NFSv4; Lustre mounted with `flock`).
"""

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from nemo_ckpt.checkpoint.layout import LOCK_NAME


class DirectoryLockedError(RuntimeError):
    """Another run holds the checkpoint directory's lock."""


class DirectoryLock:
    """The writer lock of `directory`: `acquire` takes it or raises `DirectoryLockedError` naming the holder."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (without waiting) and record this process as its holder."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _read_holder(fd)
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise DirectoryLockedError(
                f"{self.path.parent} is being written by another run ({holder}); two runs on one checkpoint "
                "directory would delete each other's checkpoints: wait for it to end or stop it, or give this run "
                "another log directory or name (log.log_dir, log.name)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (closing its descriptor); the file stays, naming the last holder."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def check_free(self) -> None:
        """Raise `DirectoryLockedError` if another run holds the lock now (takes and gives it back); a directory
        that does not exist yet is free."""
        if not self.path.parent.is_dir():
            return
        self.acquire()
        self.release()


def _holder() -> dict[str, object]:
    holder: dict[str, object] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if "SLURM_JOB_ID" in os.environ:
        holder["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return holder


def _read_holder(fd: int) -> str:
    """The recorded holder, as `host=... pid=... slurm_job_id=... started=...`."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode())
        return " ".join(f"{key}={value}" for key, value in holder.items())
    except (OSError, ValueError, AttributeError):
        return "holder not recorded"

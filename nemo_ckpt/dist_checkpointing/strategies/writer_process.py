"""The writer process of async saves (`ckpt_async_writer_process`): one per training process, writing from
staging buffers in shared memory.

A writer thread in the training process shares the training thread's GIL: whenever it comes back from a write or
a checksum it takes the GIL, and the training thread waits for it between operators (on a saturated core a
background save of 0.5 GiB cost the training steps 0.057 s, half of it without checksums; a shorter GIL switch
interval made it worse). A process has its own interpreter: it runs at the lowest CPU priority on the CPU time
training leaves idle, and the training process's background thread only waits for its answer on a socket.

- `SharedArena`: shared memory (a Linux memfd) that the staging buffers are tensors in; a save sends its
  descriptor over the socket and where its tensors lie (`ArenaTensor`); the writer process maps the arena for the
  call only, so memory the training process frees is not held by the writer.
- `WriterProcess`: starts the process with one end of a socket pair, runs functions there (pickled by reference;
  `ArenaTensor`s in their arguments become tensors over the shared pages), returns their results or raises their
  errors. The process ends when the socket closes: `close`, or its parent ending in any way.
- `shared_writer_process`: this process's writer process, as Megatron-Core's persistent async worker. The strategy
  starts it at set-up (`MegatronStrategy.setup_environment`), so that its start (importing torch, a few CPU
  seconds at normal priority) overlaps the model's set-up instead of delaying the first checkpoint; it then lowers
  its own priority to the lowest.

Linux only (memfd, `SCHED_IDLE`); elsewhere async saves write from a thread of the training process.
"""

from __future__ import annotations

import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..core import CheckpointingException
from .async_utils import lower_thread_priority

ALIGNMENT = 4096  # tensors start on page boundaries in the arena (O_DIRECT writes want aligned memory)
_HEADER = struct.Struct("!Q")


def shared_memory_available() -> bool:
    """Whether this OS has what the writer process needs (memfd)."""
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux")


@dataclass(frozen=True)
class ArenaTensor:
    """Where a tensor lies in a `SharedArena`: its bytes from `offset`, its dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class SharedArena:
    """Shared memory holding tensors at page-aligned offsets; a process that maps its descriptor sees the same
    pages. Each tensor it hands out owns exactly its bytes (`torch.save` writes a tensor's whole storage)."""

    def __init__(self, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        """Room for one tensor of each (dtype, shape) in `layout`; `tensors` are those tensors, in order."""
        offsets, end = [], 0
        for dtype, shape in layout:
            offsets.append(end)
            end += -(-_nbytes(dtype, shape) // ALIGNMENT) * ALIGNMENT
        self.nbytes = max(end, ALIGNMENT)
        self.fd = os.memfd_create("nemo-ckpt-staging", os.MFD_CLOEXEC)
        weakref.finalize(self, os.close, self.fd)
        os.ftruncate(self.fd, self.nbytes)
        self.map = mmap.mmap(self.fd, self.nbytes)
        self.places = [ArenaTensor(offset, *spec) for offset, spec in zip(offsets, layout)]
        self.tensors = [arena_tensor(self.map, place) for place in self.places]


def arena_tensor(mapping: mmap.mmap, place: ArenaTensor) -> torch.Tensor:
    """The tensor at `place` in the mapped arena, owning exactly its bytes."""
    nbytes = _nbytes(place.dtype, place.shape)
    if not nbytes:
        return torch.empty(place.shape, dtype=place.dtype)
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=place.offset)
    return raw.view(place.dtype).view(place.shape)


def _send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    socket.send_fds(sock, [_HEADER.pack(len(payload))], list(fds))
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, nbytes: int, start: bytes = b"") -> bytes:
    chunks, received = [start], len(start)
    while received < nbytes:
        chunk = sock.recv(min(nbytes - received, 1 << 20))
        if not chunk:
            raise EOFError("the socket closed mid-message")
        chunks.append(chunk)
        received += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the descriptors sent with it; EOFError when the other end closed."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 1)
    if not header:
        raise EOFError("the other end closed the socket")
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, header))
    return pickle.loads(_recv_exact(sock, size)), fds


def _resolve(value: Any, mapping: mmap.mmap) -> Any:
    """`value` with every `ArenaTensor` (in dicts, lists and tuples) replaced by its tensor in `mapping`."""
    if isinstance(value, ArenaTensor):
        return arena_tensor(mapping, value)
    if isinstance(value, dict):
        return {key: _resolve(item, mapping) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_resolve(item, mapping) for item in value)
    return value


def _error_reply(error: BaseException) -> tuple[str, BaseException]:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return ("error", error)


def serve(fd: int) -> None:
    """The writer process's loop: run each call over its arena, mapped for the call, and answer it; returns when
    the socket closes."""
    lower_thread_priority()
    sock = socket.socket(fileno=fd)
    while True:
        try:
            (fn, args, kwargs, nbytes), (arena_fd,) = _recv(sock)
        except EOFError:
            return
        _send(sock, _run(fn, args, kwargs, arena_fd, nbytes))


def _run(fn: Callable, args: tuple, kwargs: dict, arena_fd: int, nbytes: int) -> tuple[str, Any]:
    """("done", result) or ("error", exception) of `fn` over the arena; the arena is unmapped once nothing refers
    to it any more (this frame's end)."""
    try:
        mapping = mmap.mmap(arena_fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(arena_fd)
    try:
        return ("done", fn(*_resolve(args, mapping), **_resolve(kwargs, mapping)))
    except BaseException as error:  # answered, raised on the training side
        return _error_reply(error)


class WriterProcess:
    """A persistent child process that runs functions over tensors of a `SharedArena` (see module doc), one call
    at a time."""

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        command = f"from {__name__} import serve; serve({child.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", command], pass_fds=(child.fileno(),), env=env)
        child.close()
        self.sock = parent
        self.calls = 0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop, self.sock, self.process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def try_call(self, arena: SharedArena, fn: Callable, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """(True, `fn(*args, **kwargs)` run in the process), or (False, None) if another call is running.
        `ArenaTensor`s of `arena` in the arguments are tensors there. The function's error is raised here; a
        process that ended raises CheckpointingException."""
        if not self._lock.acquire(blocking=False):
            return False, None
        try:
            _send(self.sock, (fn, args, kwargs, arena.nbytes), (arena.fd,))
            (kind, result), _ = _recv(self.sock)
            self.calls += 1
        except (EOFError, OSError) as error:
            self.close()
            raise CheckpointingException(
                f"the checkpoint writer process (pid {self.pid}) ended with exit code {self.process.poll()}: {error}"
            ) from error
        finally:
            self._lock.release()
        if kind == "error":
            raise result
        return True, result

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and self.process.poll() is None

    def close(self) -> None:
        """Let the process finish its call and end (it ends when the socket closes)."""
        self._finalizer()


_shared: WriterProcess | None = None
_shared_lock = threading.Lock()


def shared_writer_process() -> WriterProcess:
    """This process's writer process, started on first use (and again if it ended)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            _shared = WriterProcess()
        return _shared


def _forget_in_forked_child() -> None:
    """A forked child (a data loader worker) drops its copy of the parent's socket: the writer process must see
    the socket close when the parent ends, and it is the parent's child, not this one's."""
    global _shared
    if _shared is not None:
        _shared._finalizer.detach()
        _shared.sock.close()
        _shared = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_forked_child)


def _stop(sock: socket.socket, process: subprocess.Popen) -> None:
    sock.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()

"""Asynchronous checkpoint saves: a request to run in the background and finalize on all ranks.

Names and semantics follow Megatron-Core's `dist_checkpointing.strategies.async_utils`:
an `AsyncRequest` holds a function that writes the data (run by a persistent background
worker, while training goes on) and finalize functions (run on the training side, in order, once
the write is done on every rank). `AsyncCallsQueue` schedules requests and finalizes them.
A write that failed on any rank raises an `AsyncSaveFailure` on every rank at the
next finalize; the failed request's finalize functions do not run. With a `timeout`, a write
still running that many seconds after it was scheduled counts as failed (a stuck file system
cannot block training forever); its thread is abandoned and later writes get a new one.
The background writer runs at the lowest CPU priority (`SCHED_IDLE` on Linux, else a higher nice value), and
so do the file writer threads it starts: they take only the CPU time training leaves idle (when the training
thread waits for a write, its core is idle and the write finishes). A `timeout` counts from the scheduling, so
allow for writes that wait for idle CPU time.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..core import CheckpointingException
from ..exchange_utils import collective_device
from ..fault_points import pause_point

log = logging.getLogger(__name__)

WRITER_NICE = 10  # added to the background writer thread's nice value (Linux: per thread; 19 is the lowest)


def lower_thread_priority(increment: int = WRITER_NICE) -> str | None:
    """Give the calling thread the lowest CPU priority the OS allows (threads it starts inherit it): Linux's
    `SCHED_IDLE` (it runs only on CPU time no other thread wants), else `increment` added to its nice value.
    Returns which ("SCHED_IDLE" or "nice <value>"), or None where threads have no priority of their own (not
    Linux) or the OS refuses."""
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return None
    thread = threading.get_native_id()
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, thread) + increment)
        os.setpriority(os.PRIO_PROCESS, thread, nice)
    except OSError as error:
        log.debug("checkpoint writer keeps its priority: %s", error)
        return None
    try:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as error:
        log.debug("checkpoint writer stays in the normal scheduling class: %s", error)
        return f"nice {nice}"
    return "SCHED_IDLE"


class AsyncRequest(NamedTuple):
    """Work for an asynchronous save.

    Args:
        async_fn: writes the data, in the background; None does nothing.
        async_fn_args: positional arguments of `async_fn`.
        finalize_fns: run in order on the training side once `async_fn` is done on all ranks.
        async_fn_kwargs: keyword arguments of `async_fn`.
        is_frozen: a frozen request takes no more finalize functions.
    """

    async_fn: Callable | None
    async_fn_args: tuple
    finalize_fns: list[Callable]
    async_fn_kwargs: dict = {}
    is_frozen: bool = False

    def add_finalize_fn(self, fn: Callable) -> None:
        """Run `fn` after the finalize functions already added."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Run the request now: write, check that every rank's write worked, finalize.

        A write that failed on any rank raises CheckpointingException on every rank.
        """
        error = None
        try:
            if self.async_fn is not None:
                self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        except Exception as e:
            error = e
        raise_if_failed_anywhere(error, "Checkpoint save")
        for finalize_fn in self.finalize_fns:
            finalize_fn()

    def freeze(self) -> AsyncRequest:
        """A copy that takes no more finalize functions."""
        return self._replace(is_frozen=True)


class AsyncSaveFailure(CheckpointingException):
    """An async save failed (or timed out) on some rank; `call_idx` is its index in the queue."""

    def __init__(self, message: str, call_idx: int) -> None:
        super().__init__(message)
        self.call_idx = call_idx


@dataclass
class _Call:
    request: AsyncRequest
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    scheduled_at: float = field(default_factory=time.monotonic)


class AsyncCaller:
    """One persistent background thread per process that runs `async_fn`s one after another.

    File writes release the GIL, so the thread writes while the training loop computes; one
    thread for the whole run avoids a fork (and a copy of the process) per save. It runs at a lower
    priority than training (`lower_thread_priority`).
    """

    def __init__(self) -> None:
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="async-checkpoint-writer", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        lower_thread_priority()
        while (call := self._calls.get()) is not None:
            request = call.request
            try:
                if request.async_fn is not None:
                    request.async_fn(*request.async_fn_args, **request.async_fn_kwargs)
                pause_point("async-write-done")
            except BaseException as error:  # reported at finalize, on the training side
                call.error = error
            finally:
                call.done.set()

    def schedule(self, request: AsyncRequest) -> _Call:
        call = _Call(request)
        self._calls.put(call)
        return call

    def close(self) -> None:
        """Finish the queued writes and stop the thread."""
        self._calls.put(None)
        self._thread.join()


def _failure(what: str, error: BaseException | None) -> CheckpointingException:
    detail = f": {type(error).__name__}: {error}" if error is not None else " on another rank"
    failure = CheckpointingException(f"{what} failed{detail}")
    failure.__cause__ = error
    return failure


def raise_if_failed_anywhere(error: BaseException | None, what: str, group: dist.ProcessGroup | None = None) -> None:
    """Collective: raise CheckpointingException on every rank if `error` is set on any rank."""
    failed = error is not None
    if dist.is_initialized():
        flag = torch.tensor([int(failed)], device=collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = bool(flag.item())
    if failed:
        raise _failure(what, error)


class _ActiveAsyncRequest(NamedTuple):
    idx: int
    call: _Call


class AsyncCallsQueue:
    """Async saves in flight, finalized in order.

    `schedule_async_request` and `maybe_finalize_async_calls` are collective: call them on every
    rank of `group` (default: the whole world), the same number of times. `timeout`: seconds a
    write may take from its scheduling before it counts as failed (None: no limit).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float | None = None) -> None:
        self.async_calls: deque[_ActiveAsyncRequest] = deque()
        self.call_idx = -1
        self.group = group
        self.timeout = timeout
        self._caller: AsyncCaller | None = None

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start writing in the background; returns the call's index."""
        if self._caller is None:
            self._caller = AsyncCaller()
        self.call_idx += 1
        call = self._caller.schedule(async_request.freeze())
        self.async_calls.append(_ActiveAsyncRequest(self.call_idx, call))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the oldest calls that are done on every rank (all of them if `blocking`).

        Ranks agree with an all-reduce (skipped with `no_dist`). Returns the finalized indices.
        Raises CheckpointingException on every rank if any rank's write failed.
        """
        finalized = []
        while self.async_calls:
            idx, call = self.async_calls[0]
            if blocking:
                call.done.wait(None if self.timeout is None else max(0.0, self._time_left(call)))
            if not self._done_everywhere(idx, call, no_dist):
                break
            self.async_calls.popleft()
            for finalize_fn in call.request.finalize_fns:
                finalize_fn()
            finalized.append(idx)
        return finalized

    def _time_left(self, call: _Call) -> float:
        return call.scheduled_at + self.timeout - time.monotonic()

    def _done_everywhere(self, idx: int, call: _Call, no_dist: bool) -> bool:
        if not call.done.is_set() and self.timeout is not None and self._time_left(call) <= 0:
            call.error = TimeoutError(f"the write did not finish within ckpt_async_save_timeout={self.timeout} s")
            self._caller = None  # the stuck thread is left behind; the next save gets a new one
        done, failed = call.done.is_set(), call.error is not None
        if not no_dist and dist.is_initialized():
            flags = torch.tensor(
                [int(not done), int(failed), idx, -idx], dtype=torch.int64, device=collective_device(self.group)
            )
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            not_done, any_failed, max_idx, neg_min_idx = flags.tolist()
            if max_idx != -neg_min_idx:
                raise CheckpointingException(
                    f"Ranks finalize different async checkpoint calls ({-neg_min_idx} to "
                    f"{max_idx}): call maybe_finalize_async_calls on every rank"
                )
            done, failed = not not_done, bool(any_failed)
        if failed:
            self.async_calls.popleft()
            failure = _failure(f"Async checkpoint save #{idx}", call.error)
            raise AsyncSaveFailure(str(failure), idx) from call.error
        return done

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def close(self) -> None:
        """Finalize every call (blocking), then stop the background worker."""
        try:
            self.maybe_finalize_async_calls(blocking=True)
        finally:
            if self._caller is not None:
                self._caller.close()
                self._caller = None

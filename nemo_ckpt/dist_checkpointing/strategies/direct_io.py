"""O_DIRECT writes of large tensors: their bytes go from memory to the disk without the page cache (no copy, next
to no CPU time). O_DIRECT wants memory addresses, file offsets and lengths on block boundaries; a tensor's memory
rarely starts on a page boundary (torch's allocator: a page + 64 bytes), so the writer places each large tensor in
its file at the same offset within a block as its memory within a page, and writes the whole blocks between with
O_DIRECT, the partial first and last blocks through the page cache (`filesystem_async.ItemFileStream`). Reads stay
buffered: on our VM O_DIRECT reads were no faster, and they would miss a checkpoint still in the page cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DIRECT_ALIGNMENT = 4096  # file offsets, lengths and memory addresses on (logical) block boundaries
DIRECT_MIN_BYTES = 1 << 20  # tensors this large are moved with O_DIRECT


def open_direct(path: Path, flags: int) -> int | None:
    """A descriptor of the file at `path` opened with `flags | O_DIRECT`; None where the OS or file system has none."""
    if not hasattr(os, "O_DIRECT") or not sys.platform.startswith("linux"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError:  # EINVAL: not supported by this file system
        return None


def direct_span(address: int, file_offset: int, nbytes: int) -> tuple[int, int]:
    """(head, body): after its first `head` bytes, the `nbytes` at memory `address` and `file_offset` have `body`
    bytes of whole blocks on block boundaries in both; (0, 0) where the offsets within a block differ."""
    if (address - file_offset) % DIRECT_ALIGNMENT:
        return 0, 0
    head = -address % DIRECT_ALIGNMENT
    return head, (nbytes - head) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT

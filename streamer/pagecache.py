"""What the page cache holds of a file, and how to empty it (for cold-cache loads)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from streamer.engine import native


def resident_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of ``path`` currently in the page cache (mincore)."""
    return native.resident_bytes(os.fspath(path))[0]


def evict(path: str | os.PathLike[str]) -> None:
    """Asks the kernel to drop the file's clean pages (no special rights needed)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_and_verify(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Evicts every file and returns the bytes still resident afterwards (0 when truly cold)."""
    paths = list(paths)
    for path in paths:
        evict(path)
    return sum(resident_bytes(path) for path in paths)

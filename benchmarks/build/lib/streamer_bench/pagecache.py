"""The page cache's state before a run: evicted and verified empty (cold), or fully resident (warm).

Eviction is ``posix_fadvise(DONTNEED)`` and verification ``mincore`` (through the engine), both
without special rights, unlike ``drop_caches``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from streamer.engine import native

_READ_CHUNK = 8 << 20
_STATE_ATTEMPTS = 3


class CacheStateError(RuntimeError):
    """The requested page-cache state could not be reached (so no figure is reported)."""


def resident_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of ``path`` currently in the page cache (mincore)."""
    return native.resident_bytes(os.fspath(path))[0]


def resident_total(files: Iterable[str | os.PathLike[str]]) -> int:
    """Bytes of ``files`` now in the page cache."""
    return sum(resident_bytes(path) for path in files)


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
    return resident_total(paths)


def make_cold(files: Sequence[Path]) -> int:
    """Evicts ``files`` and returns the bytes still resident (0 unless eviction failed)."""
    resident = -1
    for attempt in range(_STATE_ATTEMPTS):
        resident = evict_and_verify(files)
        if resident == 0:
            break
        time.sleep(0.2 * (attempt + 1))  # pages under writeback or mapped elsewhere may need a moment
    return resident


def _read_through(path: Path) -> None:
    buffer = bytearray(_READ_CHUNK)
    with open(path, "rb", buffering=0) as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while fh.readinto(buffer):
            pass


def make_warm(files: Sequence[Path]) -> int:
    """Reads whatever part of ``files`` is not cached; returns bytes still missing afterwards.

    Reads again what went missing meanwhile: on this VM a few hundred KiB of a just-read file were
    sometimes reclaimed with 18 GiB free, and a ceiling's preparation failed the whole bench.
    """
    missing = -1
    for attempt in range(_STATE_ATTEMPTS):
        missing = 0
        for path in files:
            size = path.stat().st_size
            if resident_bytes(path) < size:
                _read_through(path)
            missing += size - resident_bytes(path)
        if missing == 0:
            break
        time.sleep(0.2 * (attempt + 1))
    return missing

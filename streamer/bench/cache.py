"""Page-cache state before a run: evicted and verified empty (cold), or fully resident (warm).

Eviction is ``posix_fadvise(DONTNEED)`` and verification ``mincore``, both through
``streamer.pagecache`` (no special rights needed, unlike ``drop_caches``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

_READ_CHUNK = 8 << 20
_STATE_ATTEMPTS = 3


class CacheStateError(RuntimeError):
    """The requested page-cache state could not be reached (so no figure is reported)."""


def _pagecache() -> ModuleType:
    try:
        from streamer import pagecache
    except ImportError as exc:  # the engine is not built: no way to verify anything
        raise CacheStateError(
            f"streamer.pagecache is unavailable, cannot verify the page cache: {exc}"
        ) from exc
    return pagecache


def resident_bytes(files: Sequence[Path]) -> int:
    """Bytes of ``files`` now in the page cache."""
    pagecache = _pagecache()
    return sum(int(pagecache.resident_bytes(f)) for f in files)


def make_cold(files: Sequence[Path]) -> int:
    """Evicts ``files`` and returns the bytes still resident (0 unless eviction failed)."""
    pagecache = _pagecache()
    resident = -1
    for attempt in range(_STATE_ATTEMPTS):
        resident = int(pagecache.evict_and_verify(files))
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
            if resident_bytes([path]) < size:
                _read_through(path)
            missing += size - resident_bytes([path])
        if missing == 0:
            break
        time.sleep(0.2 * (attempt + 1))
    return missing

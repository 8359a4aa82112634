"""The host staging ring: one host allocation cut into equal slots that reads land in.

It is allocated once per ``Streamer`` (page-locked when the copy engine needs it, which is
expensive: hence once) and reused by every run and every file of that handle. Which slot
holds what is the run's business (``run/slots.py``); the ring only owns the memory.
"""

from __future__ import annotations

import time

import torch

from streamer.destinations.cpu import MemoryBudget, allocate_buffer

MAX_SLOT_BYTES = 64 << 20  # a copy this large runs near the link's peak; more slots overlap better
MIN_SLOTS = 8


def ring_bytes_for(needed: int, limit: int, *, alignment: int, pinned: bool) -> int:
    """The ring for a run that reads ``needed`` bytes under ``limit``.

    A pinned ring is a power of two: torch's pinned allocator rounds every request up to
    one, so any other size would pin (and hold) up to twice what the limit allows.
    """
    size = max(alignment, min(limit, needed))
    if pinned:
        size = min(1 << (size - 1).bit_length(), limit)  # round up, unless that breaks the limit
        size = 1 << (size.bit_length() - 1)  # then down to a power of two
    return size


def slot_size_for(ring_bytes: int, alignment: int) -> int:
    """Aim for ``MIN_SLOTS`` slots of at most ``MAX_SLOT_BYTES``, aligned, at least one alignment unit."""
    target = min(MAX_SLOT_BYTES, ring_bytes // MIN_SLOTS)
    return max(alignment, target - target % alignment)


class HostRing:
    """``slots`` slots of ``slot_size`` bytes, each starting at an ``alignment``-aligned address."""

    def __init__(self, ring_bytes: int, *, alignment: int, pinned: bool) -> None:
        self.slot_size = slot_size_for(ring_bytes, alignment)
        self.slots = max(1, ring_bytes // self.slot_size)
        self.pinned = pinned
        size = self.slots * self.slot_size
        started = time.perf_counter()
        if pinned:
            self._memory = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            if self._memory.data_ptr() % alignment:  # cudaHostAlloc returns whole pages
                raise MemoryError(f"pinned memory at {self._memory.data_ptr():#x} is not {alignment}-aligned")
        else:
            self._memory, _ = allocate_buffer(size, hugepages=False, budget=MemoryBudget(None))
        self.alloc_seconds = time.perf_counter() - started

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_size

    def slot(self, index: int) -> torch.Tensor:
        return self._memory[index * self.slot_size : (index + 1) * self.slot_size]

    def address(self, index: int) -> int:
        return self._memory.data_ptr() + index * self.slot_size


class RingCache:
    """Lends a handle's ring to one run at a time and keeps it for the next run.

    A run that starts while another holds the ring (``get_tensor`` during an iteration)
    gets a ring of its own. A ring too small for a run is dropped before a larger one is
    allocated, so two never coexist.
    """

    def __init__(self) -> None:
        self._spare: HostRing | None = None

    def acquire(self, ring_bytes: int, *, alignment: int, pinned: bool) -> tuple[HostRing, float]:
        """A ring of at least ``ring_bytes`` (or the spare, if it is large enough) and the seconds
        spent allocating it (0 for the spare)."""
        ring, self._spare = self._spare, None
        if ring is not None and ring.pinned == pinned and ring.nbytes >= ring_bytes:
            return ring, 0.0
        del ring
        ring = HostRing(ring_bytes, alignment=alignment, pinned=pinned)
        return ring, ring.alloc_seconds

    def give_back(self, ring: HostRing) -> None:
        if self._spare is None or self._spare.nbytes < ring.nbytes:
            self._spare = ring

    def clear(self) -> None:
        """Frees the spare ring (its memory goes once no run uses it)."""
        self._spare = None

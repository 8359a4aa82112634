"""The host staging ring: one host allocation cut into equal slots that reads land in.

It is allocated once per ``Streamer`` (page-locked by the copy engine that needs it, which is
expensive: hence once) and reused by every run and every file of that handle. Which slot
holds what is the run's business (``run/slots.py``); the ring only owns the memory.
"""

from __future__ import annotations

import time
import weakref

import torch

from streamer.destinations.buffers import MemoryBudget, allocate_buffer
from streamer.destinations.copy_engine import CopyEngine, Unpin

MAX_SLOT_BYTES = 64 << 20  # a copy this large runs near the link's peak; more slots overlap better
MIN_SLOTS = 8


def ring_shape(needed: int, limit: int, *, alignment: int) -> tuple[int, int]:
    """``(slot_size, slots)`` of the ring for a run that reads ``needed`` bytes under ``limit``:
    ``MIN_SLOTS`` slots of at most ``MAX_SLOT_BYTES`` where that fits, each a whole number of
    alignment units."""
    ring_bytes = max(alignment, min(limit, needed))
    target = min(MAX_SLOT_BYTES, ring_bytes // MIN_SLOTS)
    slot_size = max(alignment, target - target % alignment)
    return slot_size, max(1, ring_bytes // slot_size)


def _unpin(unpin: Unpin, memory: torch.Tensor) -> None:
    """Undoes the pinning; ``memory``, held by the finalizer until here, is freed after."""
    unpin()


class HostRing:
    """``slots`` slots of ``slot_size`` bytes in mapped pages (each slot starts a whole number
    of alignment units in), prepared by ``engine.pin`` for its copies until the ring is
    garbage. ``hugepages`` as ``StreamerConfig.hugepages``: a 1 GiB ring of 4 KiB pages took
    0.3 s of an 8 GiB load to an H200 to fault in and pin."""

    def __init__(self, slot_size: int, slots: int, *, engine: CopyEngine, hugepages: bool) -> None:
        self.slot_size = slot_size
        self.slots = slots
        self.pinned = engine.pinned
        started = time.perf_counter()
        self._memory, _ = allocate_buffer(self.nbytes, hugepages=hugepages, budget=MemoryBudget(None))
        weakref.finalize(self, _unpin, engine.pin(self._memory), self._memory)
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

    def acquire(
        self, slot_size: int, slots: int, *, engine: CopyEngine, hugepages: bool
    ) -> tuple[HostRing, float]:
        """A ring of ``slots`` slots of ``slot_size`` for ``engine`` (or the spare, if it holds as
        many bytes and is pinned alike) and the seconds spent allocating it (0 for the spare)."""
        ring, self._spare = self._spare, None
        if ring is not None and ring.pinned == engine.pinned and ring.nbytes >= slot_size * slots:
            return ring, 0.0
        del ring
        ring = HostRing(slot_size, slots, engine=engine, hugepages=hugepages)
        return ring, ring.alloc_seconds

    def give_back(self, ring: HostRing) -> None:
        if self._spare is None or self._spare.nbytes < ring.nbytes:
            self._spare = ring

    def clear(self) -> None:
        """Frees the spare ring (its memory goes once no run uses it)."""
        self._spare = None

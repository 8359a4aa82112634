"""The packed sink: one sliced tensor's ranges, read back to back into one CPU buffer.

A tensor-parallel shard of a weight (``get_slice(name)[:, a:b]``) can be thousands of ranges. The
tensor is one engine unit that completes once all of them are read (``Unit.need``), and the reads
are one ``BlockArray``: planning, submitting and completing cost a few array operations, not
Python per range. ``dropin`` gathers the selection out of the buffer (``slicing.Packing``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamer.backends.base import FileRead
from streamer.destinations.buffers import MemoryBudget, allocate_buffer
from streamer.engine import native
from streamer.observe.metrics import LoadMetrics
from streamer.plan.selection import Selection
from streamer.plan.slicing import Packing
from streamer.run.driver import Submit


class PackedSink:
    """Reads ``packing`` of the selection's one tensor; its ``tensor`` is the packed uint8 buffer."""

    def __init__(
        self, packing: Packing, selection: Selection, metrics: LoadMetrics, *, hugepages: bool
    ) -> None:
        assert len(selection.with_bytes()) == 1, "a packed read is of one tensor"
        self._packing = packing
        self._hugepages = hugepages
        self._unit = native.Unit(0, int(packing.acc_begin[0]), int(packing.acc_end[-1]), packing.need)
        self._budget = MemoryBudget(None)
        self._buffer: torch.Tensor | None = None
        self._submitted = self._read = self._delivered = False
        self.metrics = metrics
        metrics.bytes = packing.need

    def open_page_fill(self, file_reads: Sequence[FileRead]) -> native.PageFill | None:
        return None  # ranges are packed back to back, not in whole pages

    def plan(self) -> list[native.Unit]:
        return [self._unit]

    def submit_what_fits(self, submit: Submit) -> bool:
        if self._submitted:
            return True
        packing = self._packing
        self._budget.try_reserve(packing.size, force=True)  # the bytes the caller asked for
        self._buffer, address = allocate_buffer(packing.size, hugepages=self._hugepages, budget=self._budget)
        blocks = native.BlockArray.build(
            file=self._unit.file,
            unit=0,
            acc_begin=packing.acc_begin,
            acc_end=packing.acc_end,
            read_offset=packing.read_offset,
            read_length=packing.read_length,
            dst=packing.dst,
        )
        self._submitted = True
        submit(blocks, address)
        return True

    @property
    def reading(self) -> bool:
        return self._submitted and not self._read

    @property
    def busy(self) -> bool:
        return False

    def on_read(self, units: Sequence[int]) -> None:
        self._read = self._read or 0 in units

    def settle(self) -> None:
        """Nothing of the sink's own to wait for."""

    def completed(self) -> list[int]:
        if self._read and not self._delivered:
            self._delivered = True
            return [0]
        return []

    def tensor(self, position: int) -> torch.Tensor:
        assert position == 0 and self._buffer is not None
        buffer, self._buffer = self._buffer, None
        return buffer

    @property
    def peak_bytes(self) -> int:
        return self._budget.peak

    def close(self) -> None:
        """The buffer is unmapped once the caller lets go of it (or now, if it was never handed out)."""
        self._buffer = None

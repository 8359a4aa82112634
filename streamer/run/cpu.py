"""The CPU sink: tensors are read into CPU buffers under the memory budget and handed out as views.

Tensors are grouped into segments, each read into one buffer; a segment is queued only when
its buffer fits the budget (``memory.py``), and a buffer comes back for the next segment only
once no tensor views it (``destinations/cpu.py``).

Fresh buffers of segments read in whole pages, of files the engine reads (buffered or O_DIRECT),
go through the page fill where the config allows it (``StreamerConfig.page_fill``): their pages
are created holding their bytes. A page of such a buffer must not be touched before it is filled.
A tensor is handed out once its own bytes are read, while the rest of its buffer may still be
filling: every page under its bytes was filled by the blocks that read them (blocks of a filled
segment are whole pages), and its storage is just its bytes (``tensor_view``), so nothing reached
through it lies in a page still to come. The buffer is unregistered once the segment is read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from streamer.backends.base import Delivery, FileRead
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.destinations.budget import over_limit_message, streaming_budget, warn_from_caller
from streamer.destinations.buffers import BufferPool, MemoryBudget, Prefaulter, empty_tensor, tensor_view
from streamer.engine import native
from streamer.host.machine import transparent_hugepages_kept
from streamer.observe.metrics import LoadMetrics
from streamer.plan.segments import Segment
from streamer.plan.selection import Selection
from streamer.run.driver import Submit, Tally, buffer_segments

_SLACK = 2 * DIRECT_IO_ALIGNMENT  # a buffer rounds its tensors' span out to the alignment at both ends
# Each reader places cached pages from a mapping of the file and unmaps them once they span this
# much (and at each block's end): a TLB flush on every core per unmapping against readers x this
# much of file pages resident. Once per 8 MiB block loaded 1 GiB warm 1.10x [1.02, 1.25] faster
# than every 4 MiB (2-core VM, 13 paired rounds, 2026-12-02). Under a memory_limit the caller set,
# pages are unmapped after every chunk (``native.FILL_CHUNK``): nothing outside the limit stays.
MAPPED_VIEW_BYTES = 8 << 20


class CpuSink(Tally):
    """Reads a selection into CPU buffers; unit ``i`` is the ``i``-th tensor that has bytes."""

    def __init__(
        self,
        config: StreamerConfig,
        selection: Selection,
        metrics: LoadMetrics,
        *,
        delivery: Delivery,
        request_bytes: int,
    ) -> None:
        super().__init__()
        self._refs = selection.refs
        self._loaded = selection.with_bytes()  # unit i is the tensor self._loaded[i]
        self._units = selection.units()
        self._position = selection.positions()  # unit -> position in refs
        budget = streaming_budget(config, [r.entry.nbytes for r in self._loaded])
        self._explicit_limit = config.explicit_memory_limit is not None
        self._readers = config.readers()
        # Segments of small tensors span at most a quarter of the limit: four buffers fit it.
        segment_bytes = None if budget.limit is None else max(DIRECT_IO_ALIGNMENT, budget.limit // 4 - _SLACK)
        self._segments = buffer_segments(self._units, config, segment_bytes, request_bytes, delivery)
        self._segment_of_unit = [0] * len(self._units)
        for index, segment in enumerate(self._segments):
            for unit in range(segment.first_unit, segment.last_unit + 1):
                self._segment_of_unit[unit] = index
        self._budget = MemoryBudget(budget.limit)
        self._pool = BufferPool(self._budget, hugepages=config.hugepages)
        # One thread (e.g. the S3 event loop) receives every byte: fault fresh buffers in
        # elsewhere, ahead of the bytes (see Prefaulter). The engine's O_DIRECT files get one too,
        # once the reader says which files those are (open_page_fill), for buffers not page-filled.
        self._prefaulter = Prefaulter() if delivery.one_receiver and selection.files else None
        self._prefaulted_files: Sequence[bool] = [self._prefaulter is not None] * len(selection.files)
        self._faulted_prefix: dict[int, int] = {}  # buffer address -> bytes from its start faulted in ahead
        self._fills_pages = config.fills_pages()
        self._fill_extents: list[tuple[int, int] | None] = [None] * len(self._segments)
        self._page_fill: native.PageFill | None = None
        # Segments read through the page fill: their buffer's registered range and units still unread.
        self._filling: dict[int, tuple[int, int, int]] = {}
        # Under a limit, buffers of ordinary segments share one capacity: an idle one fits any next one.
        self._common_capacity = (
            0
            if segment_bytes is None
            else max((s.size for s in self._segments if s.size <= segment_bytes + _SLACK), default=0)
        )
        self._buffers: dict[int, tuple[torch.Tensor, int]] = {}  # segment -> its buffer and charge
        self._undelivered: dict[int, int] = {}
        self._next_segment = 0
        self._warned_over_limit = False
        # Read, taken from their buffers, not yet handed to the consumer: position -> tensor, charge.
        self._taken: dict[int, tuple[torch.Tensor, int]] = {}
        self._current_charge = 0  # charge of the buffer the consumer's last tensor views
        self.metrics = metrics
        metrics.memory_limit = budget.limit
        metrics.memory_limit_source = budget.source

    def plan(self) -> list[native.Unit]:
        return self._units

    def open_page_fill(self, file_reads: Sequence[FileRead]) -> native.PageFill | None:
        if FileRead.DIRECT in file_reads:
            # An O_DIRECT read faults the fresh pages it lands in first, on the reader that then
            # waits on the device: where the page fill does not create them, another thread
            # faults them in ahead instead (_prefault).
            self._prefaulted_files = [read is FileRead.DIRECT for read in file_reads]
            self._prefaulter = self._prefaulter or Prefaulter()
        if not self._fills_pages or not file_reads:
            return None
        # An O_DIRECT read is fast only into physically contiguous pages: its blocks are filled
        # from each reader's buffer only where that buffer gets huge pages. Those buffers (8 MiB a
        # reader) live as long as the run: an automatic budget is charged with them; under a
        # memory_limit the caller set, the pages are faulted in ahead instead, so that nothing but
        # the limit's buffers is resident.
        direct_fill = transparent_hugepages_kept() and not self._explicit_limit
        self._fill_extents = [
            segment.filled_extent(DIRECT_IO_ALIGNMENT)
            if direct_fill or file_reads[segment.file] is FileRead.BUFFERED
            else None
            for segment in self._segments
        ]
        if any(self._fill_extents):
            view = native.FILL_CHUNK if self._explicit_limit else MAPPED_VIEW_BYTES
            self._page_fill, refused = native.PageFill.open(mapped_view_bytes=view)
            self.metrics.page_fill = refused or "on"
            filling_direct = direct_fill and FileRead.DIRECT in file_reads
            if self._page_fill is not None and filling_direct and self._budget.limit is not None:
                self._budget.try_reserve(self._readers * native.FILL_DIRECT_CHUNK, force=True)
        return self._page_fill

    def submit_what_fits(self, submit: Submit) -> bool:
        """Queues segments in order while the budget allows; False if one is waiting for memory.

        When nothing of this run is in flight or undelivered, the next segment is queued even
        over the limit rather than stall: what holds the memory then is the consumer.
        """
        while self._next_segment < len(self._segments):
            index = self._next_segment
            segment = self._segments[index]
            alone = not self._buffers and not self._taken
            reused = self._pool.take(segment.size)
            buffer = reused or self._new_buffer(segment, force=alone)
            if buffer is None:
                return False
            tensor, base, charge = buffer
            self._buffers[index] = (tensor, charge)
            self._undelivered[index] = segment.unit_count
            self.queued(segment.unit_count)
            self._next_segment += 1
            extent = self._fill_extents[index]
            if reused is None and extent is not None and self._register(index, base, extent):
                # Filled, its pages exist: a later segment that reuses the buffer need not fault them.
                self._faulted_prefix[base] = extent[1] if extent[0] == 0 else 0
                submit([block._replace(flags=native.BLOCK_FILL) for block in segment.blocks], base)
            else:
                self._prefault(segment, base, fresh=reused is None)
                submit(segment.blocks, base)
        return True

    def _register(self, index: int, base: int, extent: tuple[int, int]) -> bool:
        """Makes the fresh buffer's ``extent`` fillable; False (read it plainly) where refused."""
        address, size = base + extent[0], extent[1] - extent[0]
        if self._page_fill is None or not self._page_fill.register(address, size):
            return False
        self._filling[index] = (address, size, self._segments[index].unit_count)
        return True

    @property
    def busy(self) -> bool:
        return False

    def on_read(self, units: Sequence[int]) -> None:
        self.read(len(units))
        for unit in units:
            position = self._position[unit]
            # No local name for the tensor: it must not outlive the consumer's reference.
            self._taken[position] = self._take_tensor(unit)
            self.whole(position)
            index = self._segment_of_unit[unit]
            filling = self._filling.get(index)
            if filling is None:
                continue
            address, size, unread = filling
            if unread > 1:
                self._filling[index] = (address, size, unread - 1)
                continue
            del self._filling[index]
            assert self._page_fill is not None
            # Every page is filled now: if this fails, registered memory behaves as plain memory.
            self._page_fill.unregister(address, size)

    def settle(self) -> None:
        """Nothing to wait for: the next ``submit_what_fits`` reads on, over the limit if need be."""

    def tensor(self, position: int) -> torch.Tensor:
        entry = self._refs[position].entry
        if entry.nbytes == 0:
            self._current_charge = 0
            return empty_tensor(entry)
        tensor, self._current_charge = self._taken.pop(position)
        return tensor

    @property
    def peak_bytes(self) -> int:
        return self._budget.peak

    def close(self) -> None:
        """Lets go of the buffers: each is unmapped once no tensor views it."""
        prefaulter, self._prefaulter = self._prefaulter, None
        if prefaulter is not None:
            prefaulter.close()
            self.metrics.prefault_bytes = prefaulter.submitted
        self.metrics.buffers_reused = self._pool.reused
        self._taken.clear()
        self._buffers.clear()
        self._filling.clear()
        if self._page_fill is not None:
            self._page_fill.close()  # after the engine (the run closes it first): nothing fills any more
        self._pool.close()

    def _new_buffer(self, segment: Segment, *, force: bool) -> tuple[torch.Tensor, int, int] | None:
        """Fresh memory for ``segment`` if the budget allows (after unmapping idle buffers), else None.

        The buffer is charged with the tensor bytes it is made for (a shared capacity counts
        whole, less the alignment rounding): see ``MemoryBudget``.
        """
        capacity = max(segment.size, self._common_capacity)
        tensor_bytes = self._units[segment.last_unit].end - self._units[segment.first_unit].begin
        charge = max(tensor_bytes, capacity - _SLACK)
        if not self._budget.try_reserve(charge):
            self._pool.drop_idle()
            if not self._budget.try_reserve(charge):
                if not force:
                    return None
                self._warn_if_over_limit(segment, charge)
                self._budget.try_reserve(charge, force=True)
        allocated = time.perf_counter()
        try:
            buffer = self._pool.allocate(capacity, charge)
        except MemoryError:
            self._budget.release(charge)
            raise
        self.metrics.add_alloc(time.perf_counter() - allocated)
        return buffer

    def _prefault(self, segment: Segment, base: int, *, fresh: bool) -> None:
        """Has the prefaulter fault in what the segment's reads fill of the buffer at ``base``, past
        the prefix that earlier segments in it had faulted in: never a shared capacity's tail that
        no read reaches (~250 MB of a streaming 1 GiB S3 load), nor a sliced read's gaps."""
        if self._prefaulter is None or not self._prefaulted_files[segment.file]:
            return
        done = 0 if fresh else self._faulted_prefix.get(base, 0)
        extents = segment.read_extents()
        for begin, end in extents:
            if end > (begin := max(begin, done)):
                self._prefaulter.submit(base + begin, end - begin)
        for begin, end in extents:
            if begin <= done:
                done = max(done, end)
        self._faulted_prefix[base] = done

    def _warn_if_over_limit(self, segment: Segment, charge: int) -> None:
        """Once per run, when reading on needs more than the limit for a reason the user can change.

        The tensor a ``for`` loop still references while it asks for the next is not one: the
        next segment is then read beside it, over the limit, without a word.
        """
        limit = self._budget.limit
        if self._warned_over_limit or limit is None:
            return
        held = self._budget.used - self._current_charge
        if charge > limit and self._explicit_limit:
            name = self._loaded[segment.first_unit].entry.name
            message = (
                f"memory_limit {limit} is smaller than tensor {name!r} ({charge} bytes): it is read "
                "alone, over the limit; raise memory_limit, or leave it unset to size it from the checkpoint"
            )
        elif held + charge > limit:
            message = over_limit_message(limit, self._budget.used)
        else:
            return
        self._warned_over_limit = True
        warn_from_caller(message)

    def _take_tensor(self, unit: int) -> tuple[torch.Tensor, int]:
        index = self._segment_of_unit[unit]
        segment = self._segments[index]
        entry = self._loaded[unit].entry
        buffer, charge = self._buffers[index]
        tensor = tensor_view(buffer, entry.begin - segment.buffer_begin, entry)
        self._undelivered[index] -= 1
        if self._undelivered[index] == 0:
            del self._buffers[index]  # the views now own it
            del self._undelivered[index]
        return tensor, charge

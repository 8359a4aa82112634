"""The staged sink: reads land in a host ring, a copy engine moves them to their destination.

The selected tensors' file bytes are cut into slot-sized pieces regardless of tensor
boundaries; each piece is read into a free ring slot; once a piece is whole it is copied out
of its slot into the destination, and the slot returns to the ring only when every copy from
it is done (``run/slots.py``). A tensor is whole once all pieces covering it were copied, and
is handed out once the consumer was ordered after those copies. Reads wait for copies only
when no slot is free.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from streamer.backends.base import FileRead
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.destinations.buffers import empty_tensor
from streamer.destinations.copy_engine import CopyEngine, CopyTicket
from streamer.destinations.ring import MIN_SLOTS, HostRing, RingCache, ring_shape
from streamer.destinations.targets import Destination, DestinationFor, Layout
from streamer.engine import native
from streamer.errors import ConfigError, DeviceError, StreamerError
from streamer.observe.metrics import LoadMetrics
from streamer.plan.segments import SlotRead, Span, align_down, align_up, group_spans, plan_slot_reads
from streamer.plan.selection import Selection
from streamer.run.driver import Submit
from streamer.run.slots import CopyFailed, SlotTable

# Without a memory limit the ring holds two rounds of the storage's reads in flight (at least a
# page per slot, at most 1 GiB): every reader has a slot while copies drain, and the ring is no
# larger than that, because every byte of it is first-touched (or page-locked) by the load.
RING_ROUNDS = 2
MIN_DEFAULT_RING_BYTES = MIN_SLOTS * DIRECT_IO_ALIGNMENT
MAX_DEFAULT_RING_BYTES = 1 << 30


@dataclass(frozen=True)
class Staging:
    """Where a staged run's bytes go: from a ring lent by ``rings``, through ``copy_engine`` (the
    run's own, closed with it), into the destination ``destination_for`` builds on ``device``."""

    device: torch.device
    copy_engine: CopyEngine
    destination_for: DestinationFor
    rings: RingCache


class StagedSink:
    """Reads a selection through a ring into its destination; the ring is taken when the run
    starts and given back on ``close()``."""

    def __init__(
        self,
        staging: Staging,
        config: StreamerConfig,
        selection: Selection,
        metrics: LoadMetrics,
        *,
        request_bytes: int,
        reads_in_flight: int,
    ) -> None:
        self._config = config
        self._default_ring_bytes = min(
            MAX_DEFAULT_RING_BYTES, max(MIN_DEFAULT_RING_BYTES, RING_ROUNDS * reads_in_flight)
        )
        self._device = staging.device
        self._copy_engine: CopyEngine | None = staging.copy_engine
        self._rings = staging.rings
        self._refs = selection.refs
        self._loaded = selection.with_bytes()
        self._position = selection.positions()  # loaded index -> position in refs
        self._index = {position: index for index, position in enumerate(self._position)}
        spans = [Span(u.file, u.begin, u.end) for u in selection.units()]
        self._spans = spans
        # A gap shorter than one more request of this storage is read through (slicing.plan's rule);
        # regions stay two aligned pages apart so no two pieces read the same page.
        self._regions = group_spans(spans, max_gap=max(request_bytes, 2 * DIRECT_IO_ALIGNMENT))
        layout = Layout([r.entry.name for r in self._loaded], spans, self._regions)
        self._destination: Destination | None = staging.destination_for(layout)
        self.metrics = metrics
        # Set by plan(), when the run starts:
        self._ring: HostRing | None = None
        self._ring_bytes = 0
        self._pieces: list[SlotRead] = []
        self._slots = SlotTable(0)
        self._plan: _Plan | None = None
        self._pieces_left: list[int] = []  # per loaded tensor: pieces not copied yet
        self._tensors_left: list[int] = []  # per target: tensors not handed out yet
        self._tickets: dict[tuple[int, int], CopyTicket] = {}  # (piece, target) -> its copy
        self._touched: set[int] = set()  # targets that copies were scheduled into
        self._next_piece = 0
        self._stalled_piece = -1
        self._reading = 0
        self._completed: list[int] = []

    def open_page_fill(self, file_reads: Sequence[FileRead]) -> native.PageFill | None:
        return None  # the ring is reused from load to load: its pages exist

    def plan(self) -> list[native.Unit]:
        """Takes the ring and cuts the regions into its slot-sized pieces: piece ``i`` is unit ``i``."""
        assert self._copy_engine is not None and self._destination is not None
        self._ring, alloc_seconds = self._rings.acquire(
            *self._ring_shape(), engine=self._copy_engine, hugepages=self._config.hugepages
        )
        self._ring_bytes = self._ring.nbytes
        self.metrics.add_ring_alloc(alloc_seconds)
        self._pieces = plan_slot_reads(
            self._regions,
            slot_size=self._ring.slot_size,
            block_size=self._config.block_size,
            alignment=DIRECT_IO_ALIGNMENT,
        )
        self._slots = SlotTable(self._ring.slots)
        self._plan = plan = _Plan(self._pieces, self._spans, self._destination.spans)
        self._pieces_left = [last - first + 1 for first, last in plan.tensor_pieces]
        self._tensors_left = [0] * len(self._destination.spans)
        for target in plan.tensor_target:
            self._tensors_left[target] += 1
        self._copy_engine.order_after_consumer()  # load_into: the consumer may still be writing its tensors
        return [native.Unit(p.file, p.begin, p.end) for p in self._pieces]

    def submit_what_fits(self, submit: Submit) -> bool:
        """Reads the next pieces into the free slots; False (a ring stall) if a piece waits for one."""
        assert self._ring is not None
        while self._next_piece < len(self._pieces):
            slot = self._slots.take(self._next_piece)
            if slot is None:
                break
            submit(self._pieces[self._next_piece].blocks, self._ring.address(slot))
            self._reading += 1
            self._next_piece += 1
        blocked = self._next_piece < len(self._pieces)
        if blocked and self._stalled_piece != self._next_piece:
            self._stalled_piece = self._next_piece
            self.metrics.ring_stalls += 1
        return not blocked

    @property
    def reading(self) -> bool:
        return self._reading > 0

    @property
    def busy(self) -> bool:
        return self._slots.busy

    def on_read(self, units: Sequence[int]) -> None:
        """Starts copying each read piece out of its slot."""
        assert self._plan is not None and self._copy_engine is not None
        for piece in units:
            self._reading -= 1
            copies = self._plan.copies[piece]
            new = [target for target, _, _ in copies if target not in self._touched]
            if new:
                self._touched.update(new)
                self._copy_engine.order_after_consumer()  # fresh memory may be in use by the consumer
            self._slots.filled(piece)
            for target, begin, end in copies:
                ticket = self._copy(piece, target, begin, end)
                self._tickets[(piece, target)] = ticket
                self._slots.copying(piece, ticket)

    def settle(self) -> None:
        """Nothing is being read: waits for the oldest piece's copies."""
        if not self._slots.busy:
            raise StreamerError("the staged load stalled with nothing in flight")  # a planning bug
        waited = time.perf_counter()
        with self._named_copy_failure():
            self._slots.wait_oldest()
        self.metrics.add_copy_wait(time.perf_counter() - waited)

    def completed(self) -> list[int]:
        """Frees the slots of copied pieces; the tensors whose last piece that was."""
        assert self._plan is not None
        with self._named_copy_failure():
            copied = self._slots.recycle()
        completed = []
        for piece in copied:
            for index in self._plan.piece_tensors[piece]:
                self._pieces_left[index] -= 1
                if self._pieces_left[index] == 0:
                    completed.append(self._position[index])
        return completed

    def tensor(self, position: int) -> torch.Tensor:
        """Orders the consumer after the tensor's copies; its target is released after its last tensor."""
        entry = self._refs[position].entry
        if entry.nbytes == 0:
            return empty_tensor(entry, self._device)
        assert self._plan is not None and self._copy_engine is not None and self._destination is not None
        index = self._index[position]
        target = self._plan.tensor_target[index]
        first, last = self._plan.tensor_pieces[index]
        for piece in range(first, last + 1):
            self._copy_engine.consumer_wait(self._tickets[(piece, target)])
        tensor = self._destination.tensor(target, entry)
        self._tensors_left[target] -= 1
        if self._tensors_left[target] == 0:
            self._destination.release(target)
        return tensor

    @property
    def peak_bytes(self) -> int:
        return self._ring_bytes

    def close(self) -> None:
        """Lets running copies finish (a slot must outlive its copy), then returns the ring."""
        self._slots.drain()
        self._tickets.clear()
        copy_engine, self._copy_engine = self._copy_engine, None
        if copy_engine is not None:
            copy_engine.close()
        ring, self._ring = self._ring, None
        if ring is not None:
            self._rings.give_back(ring)
        self._destination = None

    def _ring_shape(self) -> tuple[int, int]:
        limit = self._config.explicit_memory_limit or self._default_ring_bytes  # auto/unlimited
        if limit < DIRECT_IO_ALIGNMENT:
            raise ConfigError(
                f"memory_limit {limit} is too small for a staged load: the ring needs at least "
                f"{DIRECT_IO_ALIGNMENT} bytes"
            )
        needed = sum(
            align_up(r.end, DIRECT_IO_ALIGNMENT) - align_down(r.begin, DIRECT_IO_ALIGNMENT)
            for r in self._regions
        )
        return ring_shape(needed, limit, alignment=DIRECT_IO_ALIGNMENT)

    def _copy(self, piece: int, target: int, begin: int, end: int) -> CopyTicket:
        assert self._ring is not None and self._copy_engine is not None and self._destination is not None
        read_begin = self._pieces[piece].read_begin
        span = self._destination.spans[target]
        src = self._ring.slot(self._slots.slot(piece))[begin - read_begin : end - read_begin]
        dst = self._destination.buffer(target)[begin - span.begin : end - span.begin]
        self.metrics.copies += 1
        return self._copy_engine.copy(src, dst)

    @contextlib.contextmanager
    def _named_copy_failure(self) -> Iterator[None]:
        """A failed copy becomes a ``DeviceError`` naming the first tensor of its piece."""
        assert self._plan is not None
        try:
            yield
        except CopyFailed as failed:
            error = failed.__cause__
            names = [self._loaded[i].entry.name for i in self._plan.piece_tensors[failed.piece]]
            raise DeviceError(
                f"copying to {self._device} failed: {error}", tensor=names[0] if names else None
            ) from error


class _Plan:
    """Index tables of a run: which tensors and copies each piece has, which pieces each tensor spans."""

    def __init__(self, pieces: Sequence[SlotRead], tensors: Sequence[Span], targets: Sequence[Span]) -> None:
        piece_keys = [(p.file, p.begin) for p in pieces]
        target_keys = [(t.file, t.begin) for t in targets]
        self.tensor_pieces: list[tuple[int, int]] = []
        self.tensor_target: list[int] = []
        self.piece_tensors: list[list[int]] = [[] for _ in pieces]
        for index, span in enumerate(tensors):
            first = bisect.bisect_right(piece_keys, (span.file, span.begin)) - 1
            last = bisect.bisect_left(piece_keys, (span.file, span.end)) - 1
            self.tensor_pieces.append((first, last))
            self.tensor_target.append(bisect.bisect_right(target_keys, (span.file, span.begin)) - 1)
            for piece in range(first, last + 1):
                self.piece_tensors[piece].append(index)
        self.copies: list[list[tuple[int, int, int]]] = []  # per piece: (target, begin, end)
        for cut in pieces:
            first = max(0, bisect.bisect_right(target_keys, (cut.file, cut.begin)) - 1)
            stop = bisect.bisect_left(target_keys, (cut.file, cut.end))
            overlaps = []
            for target in range(first, stop):
                span = targets[target]
                begin, end = max(cut.begin, span.begin), min(cut.end, span.end)
                if span.file == cut.file and begin < end:
                    overlaps.append((target, begin, end))
            self.copies.append(overlaps)

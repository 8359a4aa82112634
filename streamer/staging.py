"""One staged load run: reads land in a host ring, a copy engine moves them to their destination.

The selected tensors' file bytes are cut into slot-sized pieces regardless of tensor
boundaries; the engine reads each piece into a free ring slot; once a piece is whole it is
copied out of its slot into the destination, and the slot returns to the ring only when every
copy from it is done. A tensor is handed out once all pieces covering it were copied and the
consumer was ordered after those copies. Reads wait for copies only when no slot is free.

Like ``pipeline.LoadRun``, the run is driven from the consumer's thread.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence

import torch

from streamer.backends.base import Storage
from streamer.checkpoint import Checkpoint, TensorRef
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.destinations.copy_engine import CopyEngine, CopyTicket
from streamer.destinations.cpu import empty_tensor
from streamer.destinations.ring import HostRing, RingCache, ring_bytes_for
from streamer.destinations.targets import Destination
from streamer.engine import native
from streamer.errors import ConfigError, DeviceError, StreamerError
from streamer.planner import Piece, Span, align_down, align_up, group_spans, plan_pieces
from streamer.reader import Reader, open_reader
from streamer.selection import Selection, run_then_close

DEFAULT_RING_BYTES = 1 << 30  # reaches PCIe speed with room to spare; smaller checkpoints get less
_WAIT_MS = 100  # short enough for Ctrl-C to be noticed promptly
_POLL_MS = 1  # while copies run, how often the engine wait returns to see which ones finished


class StagedRun:
    """Reads a selection of tensors once through a ring into a destination.

    ``destination_for(regions, spans, refs)`` builds it from the read regions and each loaded
    tensor's span (engine file numbering) and reference.

    Iterate ``results()``; ``close()`` is idempotent and returns the ring to ``rings``.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        refs: Sequence[TensorRef],
        config: StreamerConfig,
        *,
        ordered: bool,
        device: torch.device,
        copy_engine: CopyEngine,
        destination_for: Callable[[Sequence[Span], Sequence[Span], Sequence[TensorRef]], Destination],
        rings: RingCache,
        storage: Storage,
    ) -> None:
        self._checkpoint = checkpoint
        self._storage = storage
        self._config = config
        self._ordered = ordered
        self._device = device
        self._copy_engine: CopyEngine | None = copy_engine
        self._rings = rings
        selection = Selection.of(refs)
        self._refs = selection.refs
        self._files = selection.files
        engine_file = selection.engine_file()
        self._position = {id(r): i for i, r in enumerate(self._refs)}
        self._loaded = selection.with_bytes()
        self._spans = [Span(engine_file[r.file], r.entry.begin, r.entry.end) for r in self._loaded]
        self._regions = group_spans(self._spans, max_gap=max(config.block_size, 2 * DIRECT_IO_ALIGNMENT))
        self._destination: Destination | None = destination_for(self._regions, self._spans, self._loaded)
        self._ring: HostRing | None = None
        self._engine: Reader | None = None
        self._copying: dict[int, list[CopyTicket]] = {}  # piece -> its copies still running
        self.metrics = selection.new_metrics()

    def results(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yields ``(name, tensor)`` in completion order, or checkpoint order if ``ordered``."""
        return run_then_close(self._run(), self.close)

    def close(self) -> None:
        """Stops reading, lets running copies finish (a slot must outlive its copy), returns the ring."""
        engine, self._engine = self._engine, None
        if engine is not None:
            self.metrics.add_engine_stats(engine.stats())
            engine.close()
        copying, self._copying = self._copying, {}
        for tickets in copying.values():
            for ticket in tickets:
                with contextlib.suppress(Exception):  # the run already failed or was abandoned
                    ticket.wait()
        copy_engine, self._copy_engine = self._copy_engine, None
        if copy_engine is not None:
            copy_engine.close()
        ring, self._ring = self._ring, None
        if ring is not None:
            self.metrics.finish(ring.nbytes)
            self._rings.give_back(ring)
        self._destination = None

    def _ring_bytes(self, pinned: bool) -> int:
        limit = self._config.explicit_memory_limit or DEFAULT_RING_BYTES  # auto/unlimited: the default ring
        if limit < DIRECT_IO_ALIGNMENT:
            raise ConfigError(
                f"memory_limit {limit} is too small for a staged load: the ring needs at least "
                f"{DIRECT_IO_ALIGNMENT} bytes"
            )
        needed = sum(
            align_up(r.end, DIRECT_IO_ALIGNMENT) - align_down(r.begin, DIRECT_IO_ALIGNMENT)
            for r in self._regions
        )
        return ring_bytes_for(needed, limit, alignment=DIRECT_IO_ALIGNMENT, pinned=pinned)

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self._copy_engine is not None and self._destination is not None
        copy_engine, destination = self._copy_engine, self._destination
        self.metrics.start()
        self._ring, alloc_seconds = self._rings.acquire(
            self._ring_bytes(copy_engine.pinned), alignment=DIRECT_IO_ALIGNMENT, pinned=copy_engine.pinned
        )
        ring = self._ring
        self.metrics.add_ring_alloc(alloc_seconds)
        pieces = plan_pieces(
            self._regions,
            slot_size=ring.slot_size,
            block_size=self._config.block_size,
            alignment=DIRECT_IO_ALIGNMENT,
        )
        plan = _Plan(pieces, self._spans, destination.spans)
        named = [
            (native.Unit(s.file, s.begin, s.end), r.entry.name)
            for s, r in zip(self._spans, self._loaded, strict=True)
        ]
        self._engine = engine = open_reader(
            self._storage,
            self._checkpoint,
            self._files,
            self._config,
            [native.Unit(p.file, p.begin, p.end) for p in pieces],
            named,
            self.metrics,
        )
        copy_engine.order_after_consumer()  # load_into: the consumer may still be writing its tensors

        free_slots = deque(range(ring.slots))
        slot_of: dict[int, int] = {}
        tickets: dict[tuple[int, int], CopyTicket] = {}  # (piece, target) -> its copy
        touched: set[int] = set()  # targets that copies were scheduled into
        pieces_left = [last - first + 1 for first, last in plan.tensor_pieces]
        tensors_left = [0] * len(destination.spans)
        for target in plan.tensor_target:
            tensors_left[target] += 1
        ready: deque[int] = deque()  # positions in self._refs, in completion order
        pending: set[int] = set()  # ordered mode: complete, waiting for their turn

        def complete(position: int) -> None:
            if self._ordered:
                pending.add(position)
            else:
                ready.append(position)

        for position, ref in enumerate(self._refs):
            if ref.entry.nbytes == 0:
                complete(position)
        loaded_index = {id(r): i for i, r in enumerate(self._loaded)}
        reading = 0
        next_piece = next_position = delivered = 0
        stalled_piece = -1

        def deliver(position: int) -> tuple[str, torch.Tensor]:
            ref = self._refs[position]
            if ref.entry.nbytes == 0:
                return ref.entry.name, empty_tensor(ref.entry, self._device)
            index = loaded_index[id(ref)]
            target = plan.tensor_target[index]
            first, last = plan.tensor_pieces[index]
            for piece in range(first, last + 1):
                copy_engine.consumer_wait(tickets[(piece, target)])
            tensor = destination.tensor(target, ref.entry)
            tensors_left[target] -= 1
            if tensors_left[target] == 0:
                destination.release(target)
            return ref.entry.name, tensor

        while delivered < len(self._refs):
            while next_piece < len(pieces) and free_slots:
                slot = free_slots.popleft()
                slot_of[next_piece] = slot
                self._submit(pieces[next_piece], ring.address(slot))
                reading += 1
                next_piece += 1
            blocked = next_piece < len(pieces)
            if blocked and stalled_piece != next_piece:
                stalled_piece = next_piece
                self.metrics.ring_stalls += 1
            while ready or next_position in pending:
                if ready:
                    position = ready.popleft()
                else:
                    pending.discard(next_position)
                    position = next_position
                    next_position += 1
                delivered += 1
                self.metrics.tensor_delivered()
                yield deliver(position)
            if delivered == len(self._refs):
                break
            if reading:
                waited = time.perf_counter()
                completed = engine.wait(_POLL_MS if self._copying else _WAIT_MS)
                self.metrics.add_wait(time.perf_counter() - waited, blocked)
                for piece in completed:
                    reading -= 1
                    new = [t for t, _, _ in plan.copies[piece] if t not in touched]
                    if new:
                        touched.update(new)
                        copy_engine.order_after_consumer()  # fresh memory may be in use by the consumer
                    self._copying[piece] = []
                    for target, begin, end in plan.copies[piece]:
                        ticket = self._copy(ring, slot_of[piece], pieces[piece], target, begin, end)
                        tickets[(piece, target)] = ticket
                        self._copying[piece].append(ticket)
            elif self._copying:
                waited = time.perf_counter()
                oldest = next(iter(self._copying))
                with self._copy_failure(oldest, plan):
                    for ticket in self._copying[oldest]:
                        ticket.wait()
                self.metrics.add_copy_wait(time.perf_counter() - waited)
            else:
                raise StreamerError("the staged load stalled with nothing in flight")  # a planning bug
            for piece in [p for p in self._copying if self._copied(p, plan)]:
                del self._copying[piece]
                free_slots.append(slot_of.pop(piece))
                for index in plan.piece_tensors[piece]:
                    pieces_left[index] -= 1
                    if pieces_left[index] == 0:
                        complete(self._position[id(self._loaded[index])])

    def _submit(self, piece: Piece, slot_address: int) -> None:
        assert self._engine is not None
        self._engine.submit([block._replace(dst=slot_address + block.dst) for block in piece.blocks])
        self.metrics.blocks += len(piece.blocks)

    def _copy(self, ring: HostRing, slot: int, piece: Piece, target: int, begin: int, end: int) -> CopyTicket:
        assert self._copy_engine is not None and self._destination is not None
        span = self._destination.spans[target]
        src = ring.slot(slot)[begin - piece.read_begin : end - piece.read_begin]
        dst = self._destination.buffer(target)[begin - span.begin : end - span.begin]
        self.metrics.copies += 1
        return self._copy_engine.copy(src, dst)

    def _copied(self, piece: int, plan: _Plan) -> bool:
        with self._copy_failure(piece, plan):
            return all(ticket.done() for ticket in self._copying[piece])

    @contextlib.contextmanager
    def _copy_failure(self, piece: int, plan: _Plan) -> Iterator[None]:
        """A failed copy becomes a ``DeviceError`` naming the first tensor of its piece."""
        try:
            yield
        except StreamerError:
            raise
        except Exception as exc:
            names = [self._loaded[i].entry.name for i in plan.piece_tensors[piece]]
            raise DeviceError(
                f"copying to {self._device} failed: {exc}", tensor=names[0] if names else None
            ) from exc


class _Plan:
    """Index tables of a run: which tensors and copies each piece has, which pieces each tensor spans."""

    def __init__(self, pieces: Sequence[Piece], tensors: Sequence[Span], targets: Sequence[Span]) -> None:
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

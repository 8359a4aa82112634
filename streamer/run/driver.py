"""The run driver: reads a selection of tensors once into a sink and hands them out whole.

The run is driven from the consumer's thread: each time it asks for the next tensor, the sink
queues every read its memory allows, whole tensors are handed out (in completion order, or in
checkpoint order if ``ordered``), then the run waits with the GIL released, in short steps so
that Ctrl-C is noticed, for the reader to report finished units. Reader threads never wait for
the consumer unless the sink is out of memory.

Where bytes land and when a tensor is whole there is the sink's business (``run/cpu.py``: CPU
buffers; ``run/staged.py``: host ring and copy engine). Ordering, zero-size tensors, the first
error, metrics and cleanup are the driver's, the same for every sink.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Protocol

import torch

from streamer.backends.base import Delivery, FileRead, Storage
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.engine import native
from streamer.engine.reader import Reader, open_reader
from streamer.observe.metrics import LoadMetrics
from streamer.plan.checkpoint import Checkpoint, TensorRef
from streamer.plan.segments import Segment, plan_segments
from streamer.plan.selection import Selection, run_then_close

_WAIT_MS = 100  # short enough for Ctrl-C to be noticed promptly
_POLL_MS = 1  # while the sink's own work runs (copies), how often the wait returns to look at it

Submit = Callable[[Sequence[native.Block], int], None]
"""Queues blocks whose ``dst`` are offsets into memory at the given address."""


class Sink(Protocol):
    """Where a run's bytes land, and when a tensor is whole there.

    Tensors are named by their position in the selection's ``refs``. A sink reads through the
    run's reader what it reads, but may complete tensors it did not read (bytes from a peer).
    """

    def plan(self) -> Sequence[native.Unit]:
        """Readies the memory reads land in; the units the reader counts (unit ``i`` has id ``i``)."""

    def open_page_fill(self, file_reads: Sequence[FileRead]) -> native.PageFill | None:
        """Once the reader has opened the files: the page fill that its ``BLOCK_FILL`` blocks of the
        engine files in ``file_reads`` will go through (the sink closes it), or None."""

    def submit_what_fits(self, submit: Submit) -> bool:
        """Queues every read there is memory for now; False if the next one waits for memory."""

    @property
    def reading(self) -> bool:
        """Reads were queued that the reader has not reported finished."""

    @property
    def busy(self) -> bool:
        """Work of the sink's own is under way (copies): the run must look again soon."""

    def on_read(self, units: Sequence[int]) -> None:
        """The reader finished these units."""

    def settle(self) -> None:
        """Nothing is being read: waits for the sink's own work to move on, if it has any."""

    def completed(self) -> Iterable[int]:
        """The positions of the tensors that became whole since the last call."""

    def tensor(self, position: int) -> torch.Tensor:
        """The tensor at ``position`` (zero-size ones included) for the consumer; asked once, when whole."""

    @property
    def peak_bytes(self) -> int:
        """The most memory the run held at once for reading, for its metrics."""

    def close(self) -> None:
        """Lets go of memory and threads (no read runs any more); idempotent."""


class Tally:
    """The bookkeeping sinks that read in units share: units queued and not yet read (``reading``)
    and the positions of tensors that became whole since the driver last asked (``completed``)."""

    def __init__(self) -> None:
        self._in_flight = 0
        self._whole: list[int] = []

    def queued(self, units: int) -> None:
        self._in_flight += units

    def read(self, units: int) -> None:
        self._in_flight -= units

    def whole(self, position: int) -> None:
        self._whole.append(position)

    @property
    def reading(self) -> bool:
        return self._in_flight > 0

    def completed(self) -> list[int]:
        completed, self._whole = self._whole, []
        return completed


def buffer_segments(
    units: Sequence[native.Unit],
    config: StreamerConfig,
    segment_bytes: int | None,
    request_bytes: int,
    delivery: Delivery,
) -> list[Segment]:
    """The segments a sink that reads into buffers of its own plans: blocks of ``block_size`` on the
    O_DIRECT alignment, cut where a request costs more than the gap, on the file's grid where the
    storage caches on it."""
    return plan_segments(
        units,
        block_size=config.block_size,
        segment_bytes=segment_bytes,
        alignment=DIRECT_IO_ALIGNMENT,
        request_bytes=request_bytes,
        file_grid=delivery.file_grid,
    )


SinkFor = Callable[[Selection, LoadMetrics], Sink]


class Run:
    """Reads ``refs`` once, from ``storage`` into the sink that ``sink_for`` makes.

    Iterate ``results()``; ``close()`` is idempotent.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        refs: Sequence[TensorRef],
        config: StreamerConfig,
        sink_for: SinkFor,
        *,
        ordered: bool,
        storage: Storage,
    ) -> None:
        self._checkpoint = checkpoint
        self._storage = storage
        self._config = config
        self._ordered = ordered
        selection = Selection.of(refs)
        self._refs = selection.refs
        self._files = selection.files
        loaded = selection.with_bytes()
        self._named = [(unit, ref.entry.name) for unit, ref in zip(selection.units(), loaded, strict=True)]
        self.metrics = selection.new_metrics()
        self._sink = sink_for(selection, self.metrics)
        self._reader: Reader | None = None
        self._started = False

    def results(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yields ``(name, tensor)`` in completion order, or checkpoint order if ``ordered``."""
        return run_then_close(self._run(), self.close)

    def close(self) -> None:
        """Stops reading (reads in flight end first), then lets the sink free its memory."""
        reader, self._reader = self._reader, None
        try:
            if reader is not None:
                self.metrics.add_engine_stats(reader.stats())
                reader.close()
        finally:
            self._sink.close()
        if self._started:
            self._started = False
            self.metrics.finish(self._sink.peak_bytes)

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.metrics.start()
        self._started = True
        sink = self._sink
        units = sink.plan()
        self._reader = reader = open_reader(
            self._storage, self._checkpoint, self._files, self._config, units, self._named, self.metrics
        )
        fill = sink.open_page_fill(reader.file_reads)
        if fill is not None:
            reader.set_fill(fill)
        ready: deque[int] = deque()  # whole, in completion order
        pending: set[int] = set()  # ordered: whole, waiting for their turn
        complete = pending.update if self._ordered else ready.extend
        complete(position for position, ref in enumerate(self._refs) if ref.entry.nbytes == 0)
        next_position = delivered = 0
        while delivered < len(self._refs):
            blocked = not sink.submit_what_fits(self._submit)
            while ready or next_position in pending:
                if ready:
                    position = ready.popleft()
                else:
                    pending.remove(next_position)
                    position = next_position
                    next_position += 1
                delivered += 1
                self.metrics.tensor_delivered()
                # No local name for the tensor: the frame must not outlive the consumer's reference.
                yield self._refs[position].entry.name, sink.tensor(position)
            if delivered == len(self._refs):
                break
            if sink.reading:
                waited = time.perf_counter()
                finished = reader.wait(_POLL_MS if sink.busy else _WAIT_MS)  # raises the run's typed error
                self.metrics.add_wait(time.perf_counter() - waited, blocked)
                sink.on_read(finished)
            else:
                sink.settle()
            complete(sink.completed())

    def _submit(self, blocks: Sequence[native.Block], base: int) -> None:
        assert self._reader is not None
        if isinstance(blocks, native.BlockArray):
            self._reader.submit(blocks.rebased(base))
        else:
            self._reader.submit([block._replace(dst=base + block.dst) for block in blocks])
        self.metrics.blocks += len(blocks)

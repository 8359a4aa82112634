"""One load run: plan the reads, feed the engine under the memory budget, hand out tensors.

The run is driven from the consumer's thread: each time it asks for the next
tensor, the run queues every segment the budget allows, then waits (GIL
released) for the engine to report whole tensors. Reader threads never wait
for the consumer unless the budget is exhausted.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Generator, Iterator, Sequence

import torch

from streamer.backends.base import Storage
from streamer.checkpoint import Checkpoint, TensorRef
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.destinations.cpu import BufferPool, MemoryBudget, Prefaulter, empty_tensor, tensor_view
from streamer.engine import native
from streamer.memory import streaming_budget
from streamer.planner import Segment, plan_segments
from streamer.reader import Reader, open_reader
from streamer.selection import Selection, run_then_close

_WAIT_MS = 100  # short enough for Ctrl-C to be noticed promptly
_SLACK = 2 * DIRECT_IO_ALIGNMENT  # a buffer rounds its tensors' span out to the alignment at both ends

Result = tuple[str, torch.Tensor, int]  # name, tensor, charge of the buffer it views (0: none)


class LoadRun:
    """Reads a selection of tensors once. Iterate ``results()``; ``close()`` is idempotent."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        refs: Sequence[TensorRef],
        config: StreamerConfig,
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
        engine_file = selection.engine_file()
        self._unit_refs = selection.with_bytes()
        self._units = [native.Unit(engine_file[r.file], r.entry.begin, r.entry.end) for r in self._unit_refs]
        self._named_units = [(u, r.entry.name) for u, r in zip(self._units, self._unit_refs, strict=True)]
        budget = streaming_budget(config, [r.entry.nbytes for r in self._unit_refs])
        self._explicit_limit = config.explicit_memory_limit is not None
        # Segments of small tensors span at most a quarter of the limit: four buffers fit it.
        segment_bytes = None if budget.limit is None else max(DIRECT_IO_ALIGNMENT, budget.limit // 4 - _SLACK)
        self._segments = plan_segments(
            self._units,
            block_size=config.block_size,
            segment_bytes=segment_bytes,
            alignment=DIRECT_IO_ALIGNMENT,
        )
        self._segment_of_unit = [0] * len(self._units)
        for index, segment in enumerate(self._segments):
            for unit in range(segment.first_unit, segment.last_unit + 1):
                self._segment_of_unit[unit] = index
        self._budget = MemoryBudget(budget.limit)
        self._pool = BufferPool(self._budget, hugepages=config.hugepages)
        # One thread (e.g. the S3 event loop) receives every byte: fault its fresh buffers in
        # elsewhere, ahead of the bytes (see Prefaulter).
        self._prefaulter = Prefaulter() if storage.one_receiver and self._files else None
        # Under a limit, buffers of ordinary segments share one capacity: an idle one fits any next one.
        self._common_capacity = (
            0
            if segment_bytes is None
            else max((s.size for s in self._segments if s.size <= segment_bytes + _SLACK), default=0)
        )
        self._engine: Reader | None = None
        self._buffers: dict[int, tuple[torch.Tensor, int]] = {}  # segment -> its buffer and charge
        self._undelivered: dict[int, int] = {}
        self._next_segment = 0
        self._in_flight = 0
        self._warned_over_limit = False
        self._waiting = 0  # tensors taken from their buffers but not yet handed to the consumer
        self._current_charge = 0  # charge of the buffer the consumer's last tensor views
        self.metrics = selection.new_metrics()
        self.metrics.memory_limit = budget.limit
        self.metrics.memory_limit_source = budget.source

    def results(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yields ``(name, tensor)`` in completion order, or checkpoint order if ``ordered``."""
        return run_then_close(self._run(), self.close)

    def close(self) -> None:
        """Stops reading, waits for in-flight reads, then lets go of the buffers."""
        engine, self._engine = self._engine, None
        if engine is not None:
            self.metrics.add_engine_stats(engine.stats())
            engine.close()
            self.metrics.buffers_reused = self._pool.reused
            self.metrics.finish(self._budget.peak)
        prefaulter, self._prefaulter = self._prefaulter, None
        if prefaulter is not None:
            prefaulter.close()
            self.metrics.prefault_bytes = prefaulter.submitted
        self._buffers.clear()
        self._pool.close()

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.metrics.start()
        self._engine = open_reader(
            self._storage,
            self._checkpoint,
            self._files,
            self._config,
            self._units,
            self._named_units,
            self.metrics,
        )
        pending: dict[int, Result] = {}  # position in self._refs -> result
        ready: deque[Result] = deque()
        unit_position = [i for i, r in enumerate(self._refs) if r.entry.nbytes > 0]
        for position, ref in enumerate(self._refs):
            if ref.entry.nbytes == 0:
                pending[position] = (ref.entry.name, empty_tensor(ref.entry), 0)
        if not self._ordered:
            ready.extend(pending.values())
            pending.clear()
        next_position = 0
        delivered = 0
        while delivered < len(self._refs):
            blocked_on_memory = not self._submit_what_fits()
            while ready or next_position in pending:
                if ready:
                    name, tensor, charge = ready.popleft()
                else:
                    name, tensor, charge = pending.pop(next_position)
                    next_position += 1
                delivered += 1
                self.metrics.tensor_delivered()
                if tensor.numel():
                    self._waiting -= 1
                self._current_charge = charge
                yield name, tensor
                del tensor  # the consumer's own reference decides when its buffer is free
            if delivered == len(self._refs):
                break
            if self._in_flight == 0:
                continue  # everything read was handed out: queue more (over the limit if need be)
            waited = time.perf_counter()
            completed = self._engine.wait(_WAIT_MS)
            self.metrics.add_wait(time.perf_counter() - waited, blocked_on_memory)
            for unit in completed:
                self._in_flight -= 1
                self._waiting += 1
                # No local name for the result: the frame must not outlive the consumer's reference.
                if self._ordered:
                    pending[unit_position[unit]] = self._take_tensor(unit)
                else:
                    ready.append(self._take_tensor(unit))

    def _submit_what_fits(self) -> bool:
        """Queues segments in order while the budget allows; False if one is waiting for memory.

        When nothing of this run is in flight or undelivered, the next segment is queued even
        over the limit rather than stall: what holds the memory then is the consumer.
        """
        assert self._engine is not None
        while self._next_segment < len(self._segments):
            index = self._next_segment
            segment = self._segments[index]
            alone = not self._buffers and self._waiting == 0
            buffer = self._pool.take(segment.size) or self._new_buffer(segment, force=alone)
            if buffer is None:
                return False
            self._queue_segment(index, segment, buffer)
            self._next_segment += 1
        return True

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
        if self._prefaulter is not None:
            self._prefaulter.submit(buffer[1], capacity)
        return buffer

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
            name = self._unit_refs[segment.first_unit].entry.name
            message = (
                f"memory_limit {limit} is smaller than tensor {name!r} ({charge} bytes): it is read "
                "alone, over the limit; raise memory_limit, or leave it unset to size it from the checkpoint"
            )
        elif held + charge > limit:
            message = (
                f"memory_limit {limit} exceeded: the tensors handed out and still referenced hold "
                f"{self._budget.used} bytes; reading goes on one segment at a time. Drop (del) tensors "
                "you are done with, raise or unset memory_limit, or use streamer.load() to keep everything"
            )
        else:
            return
        self._warned_over_limit = True
        warnings.warn(message, RuntimeWarning, stacklevel=7)  # the caller of next() or get_tensor()

    def _queue_segment(self, index: int, segment: Segment, buffer: tuple[torch.Tensor, int, int]) -> None:
        assert self._engine is not None
        tensor, base, charge = buffer
        self._buffers[index] = (tensor, charge)
        self._undelivered[index] = segment.last_unit - segment.first_unit + 1
        self._in_flight += segment.last_unit - segment.first_unit + 1
        self._engine.submit([block._replace(dst=base + block.dst) for block in segment.blocks])
        self.metrics.blocks += len(segment.blocks)

    def _take_tensor(self, unit: int) -> Result:
        index = self._segment_of_unit[unit]
        segment = self._segments[index]
        entry = self._unit_refs[unit].entry
        buffer, charge = self._buffers[index]
        tensor = tensor_view(buffer, entry.begin - segment.buffer_begin, entry)
        self._undelivered[index] -= 1
        if self._undelivered[index] == 0:
            del self._buffers[index]  # the views now own it
            del self._undelivered[index]
        return entry.name, tensor, charge

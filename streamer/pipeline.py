"""One load run: plan the reads, feed the engine under the memory budget, hand out tensors.

The run is driven from the consumer's thread: each time it asks for the next
tensor, the run queues every segment the budget allows, then waits (GIL
released) for the engine to report whole tensors. Reader threads never wait
for the consumer unless the budget is exhausted.
"""

from __future__ import annotations

import bisect
import os
import time
import warnings
from collections import deque
from collections.abc import Generator, Iterator, Sequence

import torch

from streamer.checkpoint import Checkpoint, TensorRef
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.destinations.cpu import BufferPool, MemoryBudget, empty_tensor, tensor_view
from streamer.engine import native
from streamer.errors import ReadError, SourceError, StreamerError
from streamer.metrics import LoadMetrics
from streamer.planner import Segment, plan_segments
from streamer.reader import Reader
from streamer.selection import Selection, run_then_close

_WAIT_MS = 100  # short enough for Ctrl-C to be noticed promptly
_CACHED_FRACTION = 0.5  # auto mode reads a file buffered when at least this much of it is cached
_RESIDENCY_SAMPLE = 16  # auto mode looks at one MiB in 16: ~1 ms per GiB instead of ~15


class LoadRun:
    """Reads a selection of tensors once. Iterate ``results()``; ``close()`` is idempotent."""

    def __init__(
        self, checkpoint: Checkpoint, refs: Sequence[TensorRef], config: StreamerConfig, *, ordered: bool
    ) -> None:
        self._checkpoint = checkpoint
        self._config = config
        self._ordered = ordered
        selection = Selection.of(refs)
        self._refs = selection.refs
        self._files = selection.files
        engine_file = selection.engine_file()
        self._unit_refs = selection.with_bytes()
        self._units = [native.Unit(engine_file[r.file], r.entry.begin, r.entry.end) for r in self._unit_refs]
        self._named_units = [(u, r.entry.name) for u, r in zip(self._units, self._unit_refs, strict=True)]
        # A segment's buffer is its tensors' span rounded out to the alignment at both ends: with
        # spans of at most a quarter of the limit less that rounding, four buffers fit the limit.
        slack = 2 * DIRECT_IO_ALIGNMENT
        segment_bytes = (
            None if config.memory_limit is None else max(config.block_size, config.memory_limit // 4 - slack)
        )
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
        self._budget = MemoryBudget(config.memory_limit)
        self._pool = BufferPool(self._budget, hugepages=config.hugepages)
        # Under a limit, buffers of ordinary segments share one capacity: an idle one fits any next one.
        self._common_capacity = (
            0
            if segment_bytes is None
            else max((s.size for s in self._segments if s.size <= segment_bytes + slack), default=0)
        )
        self._engine: Reader | None = None
        self._buffers: dict[int, torch.Tensor] = {}
        self._undelivered: dict[int, int] = {}
        self._next_segment = 0
        self._in_flight = 0
        self._warned_over_limit = False
        self._waiting = 0  # tensors taken from their buffers but not yet handed to the consumer
        self.metrics = selection.new_metrics()

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
        self._buffers.clear()
        self._pool.close()

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.metrics.start()
        self._engine = start_engine(self._checkpoint, self._files, self._config, self._units, self.metrics)
        pending: dict[int, tuple[str, torch.Tensor]] = {}  # position in self._refs -> result
        ready: deque[tuple[str, torch.Tensor]] = deque()
        unit_position = [i for i, r in enumerate(self._refs) if r.entry.nbytes > 0]
        for position, ref in enumerate(self._refs):
            if ref.entry.nbytes == 0:
                pending[position] = (ref.entry.name, empty_tensor(ref.entry))
        if not self._ordered:
            ready.extend(pending.values())
            pending.clear()
        next_position = 0
        delivered = 0
        while delivered < len(self._refs):
            blocked_on_memory = not self._submit_what_fits()
            while ready or next_position in pending:
                if ready:
                    item = ready.popleft()
                else:
                    item = pending.pop(next_position)
                    next_position += 1
                delivered += 1
                self.metrics.tensor_delivered()
                if item[1].numel():
                    self._waiting -= 1
                yield item
            if delivered == len(self._refs):
                break
            if self._in_flight == 0:
                continue  # everything read was handed out: queue more (over the limit if need be)
            waited = time.perf_counter()
            try:
                completed = self._engine.wait(_WAIT_MS)
            except native.EngineFailure as failure:
                raise engine_error(self._checkpoint, self._files, self._named_units, failure.info) from None
            self.metrics.add_wait(time.perf_counter() - waited, blocked_on_memory)
            for unit in completed:
                self._in_flight -= 1
                result = self._take_tensor(unit)
                self._waiting += 1
                if self._ordered:
                    pending[unit_position[unit]] = result
                else:
                    ready.append(result)

    def _submit_what_fits(self) -> bool:
        """Queues segments in order while the budget allows; False if one is waiting for memory.

        When nothing of this run is in flight or undelivered, the next segment is queued even
        over the limit: either it holds a tensor larger than the limit, or the consumer keeps
        what it was given. Reading then goes on one segment at a time instead of stalling.
        """
        assert self._engine is not None
        while self._next_segment < len(self._segments):
            index = self._next_segment
            segment = self._segments[index]
            alone = not self._buffers and self._waiting == 0
            buffer = self._pool.take(segment.size) or self._new_buffer(segment, force=alone)
            if buffer is None:
                return False
            if alone and self._budget.over_limit and not self._warned_over_limit:
                self._warned_over_limit = True
                warnings.warn(
                    f"memory_limit {self._config.memory_limit} exceeded: {self._budget.used} bytes are "
                    "held by tensors already handed out or by a tensor larger than the limit; "
                    "reading continues one segment at a time",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self._queue_segment(index, segment, buffer)
            self._next_segment += 1
        return True

    def _new_buffer(self, segment: Segment, *, force: bool) -> tuple[torch.Tensor, int] | None:
        """Fresh memory for ``segment`` if the budget allows (after unmapping idle buffers), else None."""
        capacity = max(segment.size, self._common_capacity)
        if not self._budget.try_reserve(capacity):
            self._pool.drop_idle()
            if not self._budget.try_reserve(capacity, force=force):
                return None
        allocated = time.perf_counter()
        try:
            buffer = self._pool.allocate(capacity)
        except MemoryError:
            self._budget.release(capacity)
            raise
        self.metrics.add_alloc(time.perf_counter() - allocated)
        return buffer

    def _queue_segment(self, index: int, segment: Segment, buffer: tuple[torch.Tensor, int]) -> None:
        assert self._engine is not None
        self._buffers[index], base = buffer
        self._undelivered[index] = segment.last_unit - segment.first_unit + 1
        self._in_flight += segment.last_unit - segment.first_unit + 1
        try:
            self._engine.submit([block._replace(dst=base + block.dst) for block in segment.blocks])
        except native.EngineFailure as failure:
            raise engine_error(self._checkpoint, self._files, self._named_units, failure.info) from None
        self.metrics.blocks += len(segment.blocks)

    def _take_tensor(self, unit: int) -> tuple[str, torch.Tensor]:
        index = self._segment_of_unit[unit]
        segment = self._segments[index]
        entry = self._unit_refs[unit].entry
        tensor = tensor_view(self._buffers[index], entry.begin - segment.buffer_begin, entry)
        self._undelivered[index] -= 1
        if self._undelivered[index] == 0:
            del self._buffers[index]  # the views now own it
            del self._undelivered[index]
        return entry.name, tensor


def start_engine(
    checkpoint: Checkpoint,
    files: Sequence[int],
    config: StreamerConfig,
    units: Sequence[native.Unit],
    metrics: LoadMetrics,
) -> Reader:
    """A reader over ``units`` with ``files`` (checkpoint file indices) as engine files 0..n-1.

    Local files are opened by the engine; S3 objects become external files served by an
    S3 backend. A run of S3 objects only gets one (idle) engine thread.
    """
    objects = {index: checkpoint.object_of(file) for index, file in enumerate(files)}
    remote = {index: info for index, info in objects.items() if info is not None}
    spans: dict[int, tuple[int, int]] = {}  # engine file -> the bytes this run reads of it
    for unit in units:
        begin, end = spans.get(unit.file, (unit.begin, unit.end))
        spans[unit.file] = (min(begin, unit.begin), max(end, unit.end))
    workers = 1 if len(remote) == len(files) else config.concurrency
    reader = Reader(native.Engine(workers, units))
    try:
        for index, file in enumerate(files):
            path = checkpoint.headers[file].path
            if index in remote:
                engine_index = reader.add_external_file()
            else:
                try:
                    direct = _wants_direct(config, path, spans.get(index, (0, 0)))
                    engine_index, direct = reader.add_file(path, direct)
                except OSError as exc:
                    raise SourceError(f"cannot open: {exc.strerror}", path=path) from None
                metrics.file_opened(direct)
            if engine_index != index:
                raise StreamerError(f"engine numbered file {engine_index}, expected {index}", path=path)
        if remote:
            if checkpoint.s3 is None:
                raise StreamerError("an S3 checkpoint without its client")  # a bug, not user input
            reader.attach_s3(checkpoint.s3.get(), remote)
            metrics.s3_files = len(remote)
    except BaseException:
        reader.close()
        raise
    return reader


def _wants_direct(config: StreamerConfig, path: str, span: tuple[int, int]) -> bool:
    """O_DIRECT when the page cache does not hold the bytes this run reads (``span`` of the
    file, so one tensor's read looks at its own pages only); buffered reads when it does."""
    if config.io_mode == "buffered" or config.block_size % DIRECT_IO_ALIGNMENT:
        return False
    if config.io_mode == "direct":
        return True
    begin, end = span
    try:
        resident, total = native.resident_bytes(path, _RESIDENCY_SAMPLE, begin, end - begin)
    except OSError:
        return False
    return resident < total * _CACHED_FRACTION


def engine_error(
    checkpoint: Checkpoint,
    files: Sequence[int],
    tensors: Sequence[tuple[native.Unit, str]],
    info: native.ErrorInfo,
) -> StreamerError:
    """The typed error for an engine failure; ``tensors`` (sorted by file and offset) name the place."""
    if info.code == native.ERR_CANCELLED:
        return StreamerError("the load was cancelled")
    if info.file < 0 or info.file >= len(files):
        return StreamerError(f"the engine failed with status {info.code}")
    path = checkpoint.headers[files[info.file]].path
    tensor = _tensor_at(tensors, info.file, info.offset + info.got)
    if info.code == native.ERR_TRUNCATED:
        message = (
            f"file ended early: {info.got} of {info.expected} bytes read "
            "(truncated or replaced while loading?)"
        )
    elif info.code == native.ERR_READ:
        message = f"read failed: {os.strerror(info.sys_errno)}"
    else:
        message = f"read failed with engine status {info.code}"
    return ReadError(message, path=path, tensor=tensor, offset=info.offset)


def _tensor_at(tensors: Sequence[tuple[native.Unit, str]], engine_file: int, position: int) -> str | None:
    """The tensor holding ``position`` in the file, or the next one after it."""
    in_file = [(unit.end, name) for unit, name in tensors if unit.file == engine_file]
    found = bisect.bisect_right([end for end, _ in in_file], position)
    return in_file[found][1] if found < len(in_file) else None

"""What a run reads through: the native engine, fed by the checkpoint's storage.

``open_reader`` makes the engine for a run's units and has the storage register the run's files
(``Storage.feed``). Completions, the wait with the GIL released, the first-error rule and
cancellation are the engine's, whatever the storage: the runs above see one ``submit`` /
``wait`` / ``close``, and every failure comes out of them as one typed error (a storage's own, or
the engine's read failure named by file and tensor), by this one route.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from streamer.backends.base import Feed, FileRead, Named, Storage, tensor_at
from streamer.config import StreamerConfig
from streamer.engine import native
from streamer.errors import ReadError, StreamerError
from streamer.observe.metrics import LoadMetrics
from streamer.plan.checkpoint import Checkpoint


def open_reader(
    storage: Storage,
    checkpoint: Checkpoint,
    files: Sequence[int],
    config: StreamerConfig,
    units: Sequence[native.Unit],
    tensors: Named,
    metrics: LoadMetrics,
) -> Reader:
    """A reader over ``units`` with ``files`` (checkpoint file indices) as engine files 0..n-1.

    ``tensors`` (sorted by file and offset) name the place of a failure. A storage that fetches
    its blocks itself gets one idle engine thread; the local one a pool of readers, no more than
    the run can have blocks (a small ``get_tensor`` took 1.1 ms with 8 threads started, 0.6 with 1).
    """
    spans: dict[int, tuple[int, int]] = {}  # engine file -> the bytes this run reads of it
    for unit in units:
        begin, end = spans.get(unit.file, (unit.begin, unit.end))
        spans[unit.file] = (min(begin, unit.begin), max(end, unit.end))
    readers = 1
    if storage.delivery.engine_reads and files:
        readers = min(config.readers(), _most_blocks(units, config.block_size))
    metrics.readers = readers
    engine = native.Engine(readers, units)
    try:
        feed = storage.feed(
            engine,
            [checkpoint.files[f] for f in files],
            [spans.get(i, (0, 0)) for i in range(len(files))],
            tensors,
        )
    except BaseException:
        engine.close()
        raise
    return Reader(engine, feed, [checkpoint.headers[f].path for f in files], tensors, metrics)


class Reader:
    """The engine and the storage's feed of one run; failures come out as typed errors."""

    def __init__(
        self, engine: native.Engine, feed: Feed, paths: Sequence[str], tensors: Named, metrics: LoadMetrics
    ) -> None:
        self._engine = engine
        self._feed: Feed | None = feed
        self._paths = tuple(paths)
        self._tensors = tensors
        self._metrics = metrics

    @property
    def file_reads(self) -> Sequence[FileRead]:
        """Per engine file: how the engine reads it, if it does (``Feed.file_reads``)."""
        assert self._feed is not None
        return self._feed.file_reads

    def set_fill(self, fill: native.PageFill) -> None:
        """Lends the engine the page fill of the run's sink (which closes it after this reader)."""
        self._engine.set_fill(fill)

    def submit(self, blocks: Sequence[native.Block]) -> None:
        assert self._feed is not None
        try:
            self._feed.submit(blocks)
        except native.EngineFailure as failure:
            raise self._error(failure.info) from None

    def wait(self, timeout_ms: int) -> list[int]:
        """Completed unit ids (empty on timeout); raises the run's typed error once it failed."""
        try:
            return self._engine.wait(timeout_ms)
        except native.EngineFailure as failure:
            raise self._error(failure.info) from None

    def _error(self, info: native.ErrorInfo) -> StreamerError:
        feed_error = self._feed.error if self._feed is not None else None
        if info.code == native.ERR_EXTERNAL and feed_error is not None:
            return feed_error
        return engine_error(self._paths, self._tensors, info)

    def stats(self) -> dict[str, float]:
        """The engine's counters (the storage's go to the run's metrics when it closes)."""
        return self._engine.stats()

    def close(self) -> None:
        """Stops the feed first (it may write into buffers the run owns), then the engine; records
        the storage's counters. Idempotent."""
        feed, self._feed = self._feed, None
        try:
            if feed is not None:
                feed.close()
                self._metrics.add_storage_stats(feed.stats())
        finally:
            self._engine.close()


def engine_error(paths: Sequence[str], tensors: Named, info: native.ErrorInfo) -> StreamerError:
    """The typed error for an engine failure; ``paths`` are the engine files', ``tensors`` (sorted
    by file and offset) name the place."""
    if info.code == native.ERR_CANCELLED:
        return StreamerError("the load was cancelled")
    if info.file < 0 or info.file >= len(paths):
        return StreamerError(f"the engine failed with status {info.code}")
    tensor = tensor_at(tensors, info.file, info.offset + info.got)
    if info.code == native.ERR_TRUNCATED:
        message = (
            f"file ended early: {info.got} of {info.expected} bytes read "
            "(truncated or replaced while loading?)"
        )
    elif info.code == native.ERR_READ:
        message = f"read failed: {os.strerror(info.sys_errno)}"
    elif info.code == native.ERR_FILL:
        message = (
            f"placing read bytes in memory failed: {os.strerror(info.sys_errno)} "
            "(STREAMER_PAGE_FILL=0 reads without the page fill)"
        )
    elif info.code == native.ERR_NOMEM:
        message = "out of memory for a reader's buffer"
    else:
        message = f"read failed with engine status {info.code}"
    return ReadError(message, path=paths[info.file], tensor=tensor, offset=info.offset)


def _most_blocks(units: Sequence[native.Unit], block_size: int) -> int:
    """An upper bound on the blocks a run over ``units`` reads: a span of ``n`` bytes meets at most
    ``n // block_size + 2`` cells of the block grid (blocks may be aligned outwards, or shared)."""
    return max(1, sum((unit.end - unit.begin) // block_size + 2 for unit in units))

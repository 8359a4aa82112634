"""Opening a run's reader over its files, and naming the file and tensor of an engine failure.

Every run (``run/driver.py``) starts its reader here and turns an ``EngineFailure`` into a
typed error here, whatever its sink.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

from streamer.checkpoint import Checkpoint
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.engine import native
from streamer.errors import ReadError, SourceError, StreamerError
from streamer.metrics import LoadMetrics
from streamer.reader import Reader

_CACHED_FRACTION = 0.5  # auto mode reads a file buffered when at least this much of it is cached
_RESIDENCY_SAMPLE = 16  # auto mode looks at one MiB in 16: ~1 ms per GiB instead of ~15


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

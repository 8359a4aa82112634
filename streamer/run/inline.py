"""A small run of local files, read on the caller's thread: no engine and no plan.

Adapters, tokenizer-sized side files and the many small shards of some checkpoints cost a few
milliseconds each through the engine (starting and joining its readers, fresh mapped buffers
faulted in page by page), where the bytes themselves take a fraction of one. A run of at most
``StreamerConfig.inline_max_bytes`` from local files into CPU memory is therefore read here:
each tensor gets its own memory from torch's allocator (recycled by the C library, as a copy's
would be), neighbouring tensors are read with one ``preadv``, and a run of 4 MiB or more in two
halves at once (one helper thread). Warm, in one process (``benchmarks/small_files.py``): 2.8x
faster than the engine at 1.5 MiB, 1.4x at 6-10 MiB, 0.84x at 16 MiB, hence the 8 MiB default.
A short read is the same typed error the engine gives; the file and tensor are named.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Generator, Iterator, Sequence

import torch

from streamer.config import StreamerConfig
from streamer.destinations.budget import streaming_budget
from streamer.destinations.buffers import empty_tensor
from streamer.errors import ReadError, SourceError
from streamer.plan.checkpoint import Checkpoint, TensorRef
from streamer.plan.segments import stretches
from streamer.plan.selection import Selection, run_then_close

PARALLEL_MIN_BYTES = 4 << 20  # from here a run is read in two halves at once (two threads)


def fits_inline(refs: Sequence[TensorRef], config: StreamerConfig, *, keep_all: bool) -> bool:
    """Whether a run of ``refs`` under ``config`` is small enough to read inline: at most
    ``inline_max_bytes`` (it reads the tensors' bytes, nothing between them), and within an
    explicit ``memory_limit`` unless the caller keeps everything (``keep_all``)."""
    total = sum(ref.entry.nbytes for ref in refs)
    limit = None if keep_all else config.explicit_memory_limit
    return total <= config.inline_max_bytes and (limit is None or total <= limit)


class InlineRun:
    """Reads ``refs`` of ``checkpoint``'s local files once, in the caller's thread; a ``Run`` for
    the handle (``results``, ``metrics``, ``close``)."""

    def __init__(
        self, checkpoint: Checkpoint, refs: Sequence[TensorRef], config: StreamerConfig, *, keep_all: bool
    ) -> None:
        self._checkpoint = checkpoint
        selection = Selection.of(refs)
        self._refs = selection.refs
        self.metrics = selection.new_metrics()
        if keep_all:  # the caller keeps every tensor: no streaming budget applies (as for a run)
            self.metrics.memory_limit, self.metrics.memory_limit_source = None, "unlimited"
        else:
            budget = streaming_budget(config, [ref.entry.nbytes for ref in self._refs])
            self.metrics.memory_limit, self.metrics.memory_limit_source = budget.limit, budget.source

    def results(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        """Yields ``(name, tensor)`` in file and offset order (also the completion order)."""
        return run_then_close(self._run(), self.close)

    def close(self) -> None:
        """Nothing stays open between reads."""

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.metrics.start()
        started = time.perf_counter()
        tensors = {
            ref.entry.name: torch.empty(ref.entry.shape, dtype=ref.entry.dtype.torch_dtype)
            for ref in self._refs
            if ref.entry.nbytes
        }
        read = self._read_all(tensors)
        for ref in self._refs:
            entry = ref.entry
            tensor = tensors.pop(entry.name) if entry.nbytes else empty_tensor(entry)
            self.metrics.tensor_delivered()
            yield entry.name, tensor
        self.metrics.add_engine_stats({"bytes_read": read, "read_seconds": time.perf_counter() - started})
        self.metrics.finish(read)

    def _read_all(self, tensors: dict[str, torch.Tensor]) -> int:
        """Reads every tensor with bytes into its tensor of ``tensors``: neighbours in one ``preadv``,
        and a run of ``PARALLEL_MIN_BYTES`` or more in two halves at once (a copy out of the page
        cache is CPU work: torch's own copies use every core); the bytes read."""
        wanted = [ref for ref in self._refs if ref.entry.nbytes]
        paths = self._checkpoint.headers
        fds: dict[int, int] = {}
        try:
            for file in dict.fromkeys(ref.file for ref in wanted):
                fds[file] = _open_regular(paths[file].path)
            total = sum(ref.entry.nbytes for ref in wanted)
            # The affinity, not the cgroup quota (usable_cores, ~70 us of file reads): two halves
            # on a one-core quota only take turns.
            two_cores = len(os.sched_getaffinity(0)) > 1
            halves = _halves(wanted, total) if total >= PARALLEL_MIN_BYTES and two_cores else [wanted]
            failures: list[BaseException] = []

            def read(refs: Sequence[TensorRef]) -> None:
                try:
                    for stretch in _stretches(refs):
                        path = paths[stretch[0].file].path
                        views = [_bytes(tensors[ref.entry.name]) for ref in stretch]
                        _read_exactly(fds[stretch[0].file], views, stretch, path)
                except BaseException as error:  # the first failure is the run's, whichever half
                    failures.append(error)

            helper = None
            if len(halves) == 2:
                helper = threading.Thread(target=read, args=(halves[1],), name="streamer-inline")
                helper.start()
            read(halves[0])
            if helper is not None:
                helper.join()
            if failures:
                raise failures[0]
        finally:
            for fd in fds.values():
                os.close(fd)
        return total


def _open_regular(path: str) -> int:
    """The file at ``path``, opened without blocking (a FIFO put in its place would block until a
    writer came) and only if it is still a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise SourceError(f"cannot open: {exc.strerror}", path=path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SourceError("cannot open: not a regular file", path=path)
    return fd


def _halves(refs: Sequence[TensorRef], total: int) -> list[Sequence[TensorRef]]:
    """``refs`` cut at the tensor nearest half of ``total`` bytes."""
    seen = 0
    for cut, ref in enumerate(refs):
        if seen + ref.entry.nbytes / 2 >= total / 2:
            return [refs[:cut], refs[cut:]] if 0 < cut < len(refs) else [refs]
        seen += ref.entry.nbytes
    return [refs]


def _stretches(refs: Sequence[TensorRef]) -> Iterator[Sequence[TensorRef]]:
    """``refs`` (in file and offset order) in runs that lie back to back in one file."""

    def joins(first: TensorRef, previous: TensorRef, ref: TensorRef) -> bool:
        return ref.file == first.file and ref.entry.begin == previous.entry.end

    for start, stop in stretches(refs, joins):
        yield refs[start:stop]


def _bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.view(-1).view(torch.uint8).numpy().data


def _read_exactly(fd: int, views: list[memoryview], refs: Sequence[TensorRef], path: str) -> None:
    """Fills ``views``, the bytes of ``refs`` back to back in the file; a short read or an I/O error
    is a ``ReadError`` naming the file and the tensor it stopped in."""
    position = refs[0].entry.begin
    pending, index = list(views), 0
    while pending:
        try:
            got = os.preadv(fd, pending[:_IOV_MAX], position)
        except OSError as exc:
            raise ReadError(
                f"read failed: {exc.strerror}", path=path, tensor=refs[index].entry.name, offset=position
            ) from None
        if got <= 0:
            expected = refs[-1].entry.end - refs[0].entry.begin
            raise ReadError(
                f"file ended early: {position - refs[0].entry.begin} of {expected} bytes read "
                "(truncated or replaced while loading?)",
                path=path,
                tensor=refs[index].entry.name,
                offset=position,
            )
        position += got
        while pending and got >= len(pending[0]):
            got -= len(pending.pop(0))
            index += 1
        if got:
            pending[0] = pending[0][got:]


_IOV_MAX = 1024  # buffers one preadv may take (IOV_MAX on Linux)

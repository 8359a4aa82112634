"""A small run of local files, read on the caller's thread: no engine and no plan.

Adapters, tokenizer-sized side files and the many small shards of some checkpoints cost a few
milliseconds each through the engine (starting and joining its readers, fresh mapped buffers
faulted in page by page), where the bytes themselves take a fraction of one. A run of at most
``StreamerConfig.inline_max_bytes`` from local files into CPU memory is therefore read here:
each tensor gets its own memory from torch's allocator (recycled by the C library, as a copy's
would be), neighbouring tensors are read with one ``preadv``, and from 4 MiB a helper thread
takes pieces of the run from the same queue as the caller. Warm, in one process
(``benchmarks/small_files.py``): 2.8x faster than the engine at 1.5 MiB, 1.4x at 6-10 MiB, not
separable at 16 MiB, hence the 8 MiB default.
A short read is the same typed error the engine gives; the file and tensor are named.
"""

from __future__ import annotations

import dataclasses
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

PARALLEL_MIN_BYTES = 4 << 20  # from here a helper thread shares the reads
PIECE_MIN_BYTES = 512 << 10
PIECE_MAX_BYTES = 4 << 20


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
        """Reads every tensor with bytes into its tensor of ``tensors``, neighbours in one ``preadv``;
        the bytes read. From ``PARALLEL_MIN_BYTES`` a helper thread shares the pieces (a copy out of
        the page cache is CPU work: torch's own copies use every core)."""
        wanted = [ref for ref in self._refs if ref.entry.nbytes]
        paths = self._checkpoint.headers
        fds: dict[int, int] = {}
        try:
            for file in dict.fromkeys(ref.file for ref in wanted):
                fds[file] = _open_regular(paths[file].path)
            total = sum(ref.entry.nbytes for ref in wanted)
            pieces = [
                Piece(
                    fds[stretch[0].file],
                    paths[stretch[0].file].path,
                    stretch[0].entry.begin + skip,
                    stretch,
                    views,
                )
                for stretch in _stretches(wanted)
                for skip, views in _cut(
                    [_bytes(tensors[ref.entry.name]) for ref in stretch], _piece_bytes(total)
                )
            ]
            # The affinity, not the cgroup quota (usable_cores, ~70 us of file reads): two readers
            # on a one-core quota only take turns.
            shared = total >= PARALLEL_MIN_BYTES and len(pieces) > 1 and len(os.sched_getaffinity(0)) > 1
            _read_pieces(pieces, helped=shared)
        finally:
            for fd in fds.values():
                os.close(fd)
        return total


@dataclasses.dataclass(frozen=True)
class Piece:
    """One ``preadv``: ``views`` (slices of the tensors ``refs``) filled from ``position`` of ``fd``."""

    fd: int
    path: str
    position: int
    refs: Sequence[TensorRef]
    views: Sequence[tuple[int, memoryview]]  # (index in refs, bytes), back to back in the file

    def read(self) -> None:
        """Fills the views; a short read or an I/O error is a ``ReadError`` naming the file and the
        tensor it stopped in."""
        position = self.position
        pending = [view for _, view in self.views]
        done = 0
        while pending:
            try:
                got = os.preadv(self.fd, pending[:_IOV_MAX], position)
            except OSError as exc:
                raise ReadError(
                    f"read failed: {exc.strerror}", path=self.path, tensor=self._tensor(done), offset=position
                ) from None
            if got <= 0:
                stretch = self.refs[-1].entry.end - self.refs[0].entry.begin
                raise ReadError(
                    f"file ended early: {position - self.refs[0].entry.begin} of {stretch} bytes read "
                    "(truncated or replaced while loading?)",
                    path=self.path,
                    tensor=self._tensor(done),
                    offset=position,
                )
            position += got
            while pending and got >= len(pending[0]):
                got -= len(pending.pop(0))
                done += 1
            if got:
                pending[0] = pending[0][got:]

    def _tensor(self, done: int) -> str:
        return self.refs[self.views[done][0]].entry.name


def _read_pieces(pieces: Sequence[Piece], *, helped: bool) -> None:
    """Reads every piece on this thread, with a helper thread taking pieces from the same queue when
    ``helped``. The caller never waits for a helper that has not started yet (a core busy with
    torch's spinning OpenMP workers can keep it off for milliseconds): it just reads on; at the
    end it waits only for the piece the helper is in. The first failure is raised, whichever
    thread met it, and stops both."""
    queue = iter(pieces)
    take = threading.Lock()
    failures: list[BaseException] = []

    def work() -> None:
        while not failures:
            with take:
                piece = next(queue, None)
            if piece is None:
                return
            try:
                piece.read()
            except BaseException as error:
                failures.append(error)

    helper = threading.Thread(target=work, name="streamer-inline") if helped else None
    if helper is not None:
        helper.start()
    work()
    if helper is not None:
        helper.join()
    if failures:
        raise failures[0]


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


def _stretches(refs: Sequence[TensorRef]) -> Iterator[Sequence[TensorRef]]:
    """``refs`` (in file and offset order) in runs that lie back to back in one file."""

    def joins(first: TensorRef, previous: TensorRef, ref: TensorRef) -> bool:
        return ref.file == first.file and ref.entry.begin == previous.entry.end

    for start, stop in stretches(refs, joins):
        yield refs[start:stop]


def _bytes(tensor: torch.Tensor) -> memoryview:
    return tensor.view(-1).view(torch.uint8).numpy().data


def _piece_bytes(total: int) -> int:
    """How much one ``preadv`` reads: about a sixteenth of the run (so two readers end close
    together), between ``PIECE_MIN_BYTES`` and ``PIECE_MAX_BYTES``."""
    return min(max(total // 16, PIECE_MIN_BYTES), PIECE_MAX_BYTES)


def _cut(views: list[memoryview], limit: int) -> Iterator[tuple[int, list[tuple[int, memoryview]]]]:
    """``views`` (back to back in the file) in groups of at most ``limit`` bytes, a view cut where a
    group ends: each group with its distance in bytes from the first view's start, each part with
    the index of the view it came from."""
    group: list[tuple[int, memoryview]] = []
    start = done = 0
    for index, view in enumerate(views):
        while len(view):
            part = view[: limit - (done - start)]
            group.append((index, part))
            view, done = view[len(part) :], done + len(part)
            if done - start == limit:
                yield start, group
                group, start = [], done
    if group:
        yield start, group


_IOV_MAX = 1024  # buffers one preadv may take (IOV_MAX on Linux)

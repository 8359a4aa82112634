"""A small run of local files, read by the caller's own threads: no engine and no plan.

Adapters, tokenizer-sized side files and the shards of small and mid-size checkpoints cost a few
milliseconds each through the engine (starting and joining its readers, fresh mapped buffers
faulted in page by page), where the bytes themselves take a fraction of one. A run of at most
``StreamerConfig.inline_max_bytes`` from local files into CPU memory is therefore read here:
each tensor gets its own memory from torch's allocator (recycled by the C library, as a copy's
would be), neighbouring tensors are read with one ``preadv``, and from 4 MiB the pieces of the
run are shared by torch's intra-op threads (its OpenMP team where it has one, already awake
after torch's last operator; ``streamer.host.openmp``) through the engine's ``se_read_pieces``.
On 2 cores (``benchmarks/small_files.py``), 1.2-4x faster than the engine from 1.5 to 64 MiB,
warm and cold; larger runs need the engine's queue depth cold, hence the 64 MiB default.
A short read is the same typed error the engine gives; the file and tensor are named.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Generator, Iterator, Sequence
from typing import NamedTuple

import torch

from streamer.config import StreamerConfig
from streamer.destinations.budget import streaming_budget
from streamer.destinations.buffers import empty_tensor
from streamer.engine import native
from streamer.errors import ReadError, SourceError
from streamer.host import openmp
from streamer.plan.checkpoint import Checkpoint, TensorRef
from streamer.plan.segments import stretches
from streamer.plan.selection import Selection, run_then_close

PARALLEL_MIN_BYTES = 4 << 20  # from here torch's intra-op threads share the reads
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
    """Reads ``refs`` of ``checkpoint``'s local files once, before the first tensor is handed out,
    on the caller's thread (and torch's intra-op threads from ``PARALLEL_MIN_BYTES``); a ``Run``
    for the handle (``results``, ``metrics``, ``close``)."""

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
        the bytes read. From ``PARALLEL_MIN_BYTES`` the pieces are shared by torch's intra-op threads
        (a copy out of the page cache is CPU work, as torch's own copies are), on its OpenMP team
        where there is one (``streamer.host.openmp``)."""
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
                    [(tensors[ref.entry.name].data_ptr(), ref.entry.nbytes) for ref in stretch],
                    _piece_bytes(total),
                )
            ]
            threads = openmp.team_threads() if total >= PARALLEL_MIN_BYTES and len(pieces) > 1 else 1
            _read_pieces(pieces, threads)
        finally:
            for fd in fds.values():
                os.close(fd)
        return total


class Piece(NamedTuple):
    """One ``preadv``: ``views`` (parts of the tensors ``refs``) filled from ``position`` of ``fd``."""

    fd: int
    path: str
    position: int
    refs: Sequence[TensorRef]
    views: Sequence[tuple[int, int, int]]  # (index in refs, address, length), back to back in the file

    def error(self, failure: native.ErrorInfo) -> ReadError:
        """The typed error for this piece's ``failure``: the file and the tensor it stopped in."""
        tensor = self._tensor(failure.got)
        if failure.code == native.ERR_TRUNCATED:
            stretch = self.refs[-1].entry.end - self.refs[0].entry.begin
            return ReadError(
                f"file ended early: {failure.offset - self.refs[0].entry.begin} of {stretch} bytes read "
                "(truncated or replaced while loading?)",
                path=self.path,
                tensor=tensor,
                offset=failure.offset,
            )
        return ReadError(
            f"read failed: {os.strerror(failure.sys_errno)}",
            path=self.path,
            tensor=tensor,
            offset=failure.offset,
        )

    def _tensor(self, done: int) -> str:
        """The tensor that the byte ``done`` bytes into this piece belongs to."""
        for index, _, length in self.views:
            if done < length:
                return self.refs[index].entry.name
            done -= length
        return self.refs[self.views[-1][0]].entry.name


def _read_pieces(pieces: Sequence[Piece], threads: int) -> None:
    """Reads every piece on ``threads`` threads (the caller among them); the first failure is
    raised, after which no thread takes another piece."""
    buffers: list[tuple[int, int]] = []
    table = []
    for piece in pieces:
        table.append((piece.position, piece.fd, len(buffers), len(piece.views)))
        buffers.extend((address, length) for _, address, length in piece.views)
    team = openmp.running_team(threads) if threads > 1 else None
    failure = native.read_pieces(table, buffers, threads, team)
    if failure is not None:
        raise pieces[failure.file].error(failure)


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


def _piece_bytes(total: int) -> int:
    """How much one ``preadv`` reads: about a sixteenth of the run (so two readers end close
    together), between ``PIECE_MIN_BYTES`` and ``PIECE_MAX_BYTES``."""
    return min(max(total // 16, PIECE_MIN_BYTES), PIECE_MAX_BYTES)


def _cut(views: list[tuple[int, int]], limit: int) -> Iterator[tuple[int, list[tuple[int, int, int]]]]:
    """``views`` ``(address, length)`` (back to back in the file) in groups of at most ``limit``
    bytes, a view cut where a group ends: each group with its distance in bytes from the first
    view's start, each part as ``(index of its view, address, length)``."""
    group: list[tuple[int, int, int]] = []
    start = done = 0
    for index, (address, length) in enumerate(views):
        while length:
            part = min(length, limit - (done - start))
            group.append((index, address, part))
            address, length, done = address + part, length - part, done + part
            if done - start == limit:
                yield start, group
                group, start = [], done
    if group:
        yield start, group

"""The storage contract: what every place a checkpoint can live in implements.

A ``Storage`` is one open session with a storage, owned by the handle that opened it (for S3: a
client, ~0.1 s to make, reused by every run of the handle; closed with it). It resolves a source
into files and reads the front of each (its size and, usually, its whole header; the header is
parsed by ``checkpoint.read_checkpoint``, the same for every storage). For each run it registers
the run's files with the native engine and returns a ``Feed`` that serves their blocks:

- the local storage hands the files to the engine's own reader threads (``pread``, O_DIRECT);
- any other storage registers external files and fetches each block itself, straight into the
  run's buffers, crediting it to the engine as it lands (``ExternalFeed``). The engine counts
  bytes, queues whole tensors and wakes the run, whatever storage filled them.

A failure inside a feed stops the engine (``fail``: "an external failure") and is kept as the
feed's own typed error; ``reader.Reader`` raises that error, the one route to the caller.

An open may be provisional: a storage that remembers how a source resolved last time (the node's
cache) answers at once from that note and confirms it with the storage in the background. Runs
start at once; their feeds credit nothing before the answer, and fail with ``StaleOpen`` when the
source changed. ``confirm_open`` waits for the answer and gives the fresh open in that case:
whoever planned from the provisional one plans again (``checkpoint.confirmed``).
"""

from __future__ import annotations

import bisect
import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import NamedTuple, Protocol

from streamer.backends.sources import ResolvedSource, SourceLike
from streamer.config import StreamerConfig
from streamer.engine import native
from streamer.errors import StreamerError


class StaleOpen(StreamerError):
    """A run planned from a provisional open failed before anything was credited: the source
    changed since the note the open came from. Caught where the run was planned, which plans again
    from ``Storage.confirm_open()``; it reaches a caller only through a bug."""


class StoredFile(Protocol):
    """One file of a checkpoint as its storage saw it when it read the front (frozen data)."""

    @property
    def path(self) -> str:
        """What errors and ``FileHeader.path`` call it: a local path or a URI."""
        ...

    @property
    def size(self) -> int: ...


class FileIdentity(NamedTuple):
    """What tells one file's bytes from another's of the same size and header (group loads check
    that every rank opened the same checkpoint, ``streamer.group.identity``).

    ``place``: where the bytes are, where equal places prove equal bytes (a local file: the host's
    boot, device, inode, modification time); "" when the storage cannot say. ``content``: what the
    bytes are (an object's ETag or generation; a hash of a local file's sampled blocks, or of
    all of them); "" when nothing is known beyond size and header.
    """

    place: str = ""
    content: str = ""


class Front(NamedTuple):
    """The first ``min(size, header_bytes)`` bytes of a file (fewer only if it was cut while read)."""

    file: StoredFile
    data: bytes


class Opened(NamedTuple):
    """A resolved source: its files in checkpoint order, each with its front."""

    source: ResolvedSource
    fronts: tuple[Front, ...]


Range = tuple[StoredFile, int, int]  # a file and the bytes [begin, end) of it
Extent = tuple[int, int]  # bytes [begin, end) of a file
Named = Sequence[tuple[native.Unit, str]]  # a run's tensors (engine numbering, by file and offset), named


class ReadCost(NamedTuple):
    """What one more read request costs a storage, as the bytes it moves in that time.

    A gap between two wanted ranges shorter than ``request_bytes`` is cheaper read through than
    skipped with a request of its own; a longer one is skipped (``slicing.plan``, ``planner``).
    ``alignment``: what the storage rounds each read out to (O_DIRECT); 1, the bytes wanted only.
    """

    request_bytes: int
    alignment: int = 1


# Measured on this project's VMs. From the page cache: pread of 4 KiB..1 MiB pieces every 8th piece
# of a 256 MiB file vs 1 MiB sequential reads, 1-30 us per request at 0.7-10 GiB/s = 10-22 KiB.
LOCAL_CACHED_READ_COST = ReadCost(request_bytes=16 << 10)
# From the device (O_DIRECT): 3.6 GB/s sequential against ~50-70k 8 KiB reads/s at queue depth 8-64
# (benchmarks/slice_load.py --cold) = 50-70 KiB.
LOCAL_READ_COST = ReadCost(request_bytes=64 << 10, alignment=native.DIRECT_ALIGNMENT)
# An S3 GET: a round trip and request handling (~30-50 ms to first byte) at one connection's
# ~80-100 MB/s, ~3-5 MiB; also what any storage that does not say otherwise is charged.
REMOTE_READ_COST = ReadCost(request_bytes=4 << 20)


class Feed(ABC):
    """A storage's part of one run: serves the blocks of the run's files (engine files 0..n-1)."""

    @abstractmethod
    def submit(self, blocks: Sequence[native.Block]) -> None:
        """Queues blocks; each lands in its ``dst`` and is credited to the engine."""

    @property
    def error(self) -> StreamerError | None:
        """The typed error this feed stopped the run with (``native.ERR_EXTERNAL``), if any."""
        return None

    @property
    def file_reads(self) -> Sequence[FileRead]:
        """Per engine file: how the engine's readers read it (its fresh buffers may then go through
        the page fill); empty where the bytes arrive another way."""
        return ()

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """This run's storage counters, named as ``LoadMetrics`` reports them."""

    @abstractmethod
    def close(self) -> None:
        """Returns once nothing of this feed can write into the run's buffers. Idempotent."""


class FileRead(enum.Enum):
    """How the engine's readers read a local file."""

    BUFFERED = "buffered"  # through the page cache
    DIRECT = "direct"  # O_DIRECT: a read into a fresh page faults it in first, on the reader


class Delivery(enum.Enum):
    """How a storage's bytes reach a run's memory: the one fact a run schedules by."""

    ENGINE_READS = "engine reads"  # the engine's reader threads read them (it needs a pool of them)
    STORAGE_THREADS = "storage threads"  # the storage's own threads; nothing more is assumed
    ONE_RECEIVER = "one receiver"  # one thread (an event loop) receives every byte
    ONE_RECEIVER_ON_GRID = "one receiver, on the grid"  # and blocks lie on the file's block_size grid

    @property
    def engine_reads(self) -> bool:
        return self is Delivery.ENGINE_READS

    @property
    def one_receiver(self) -> bool:
        """Fresh buffers are faulted in on another thread, ahead of the bytes."""
        return self in (Delivery.ONE_RECEIVER, Delivery.ONE_RECEIVER_ON_GRID)

    @property
    def file_grid(self) -> bool:
        """Blocks are cut at multiples of ``block_size`` in the file (a cache kept whole chunks)."""
        return self is Delivery.ONE_RECEIVER_ON_GRID


class Storage(ABC):
    """One open session with a storage. Use as a context manager or ``close()``."""

    delivery = Delivery.STORAGE_THREADS
    read_cost = REMOTE_READ_COST  # what one more request costs (local files override it)

    @abstractmethod
    def open(self, source: SourceLike) -> Opened:
        """Resolves ``source`` into files (directory/prefix listing, index rules) and reads each front."""

    def confirm_open(self) -> Opened | None:
        """Waits until the last ``open`` is known to stand: None when it does (every open that was
        not provisional), the fresh open when the source changed since the note it came from.
        Raises what the storage answered (a denied or missing object); the same answer each time."""
        return None

    @abstractmethod
    def read_ranges(self, ranges: Sequence[Range]) -> list[bytes]:
        """The bytes of each range (all at once where the storage can); a range comes back short
        only when its file ended early."""

    def reads_in_flight(self, config: StreamerConfig) -> int:
        """The most bytes this storage's reads hold at once: ``s3.concurrency`` GETs of a block
        (local files override it with their reader threads)."""
        return config.s3.concurrency * config.block_size

    def read_cost_of(self, file: StoredFile, span: Extent) -> ReadCost:
        """What one more request costs a run reading ``span`` of ``file`` (``read_cost`` unless the
        storage knows better, e.g. local bytes already in the page cache)."""
        return self.read_cost

    def identify(self, files: Sequence[StoredFile], *, full: bool) -> list[FileIdentity]:
        """Each file's identity beyond its size and header; ``full``: a content hash must cover
        every byte (a whole read), not samples. Storages that know nothing more say nothing."""
        return [FileIdentity() for _ in files]

    @abstractmethod
    def feed(
        self, engine: native.Engine, files: Sequence[StoredFile], spans: Sequence[Extent], tensors: Named
    ) -> Feed:
        """Registers ``files`` with ``engine`` as its files 0..n-1 and returns the feed serving them.

        ``spans[i]`` is the part of file i this run reads (for choosing how to read it);
        ``tensors`` name the place of a failure (``tensor_at``).
        """

    @abstractmethod
    def close(self) -> None:
        """Releases the session (threads, connections); a later read may open it again. Idempotent."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class ExternalFeed(Feed):
    """A feed that fetches blocks outside the engine: its files are external files of the engine,
    each fetched block is credited, and the first failure stops the run (the rest are dropped)."""

    def __init__(self, engine: native.Engine, count: int) -> None:
        for expected in range(count):
            index = engine.add_external_file()
            if index != expected:
                raise StreamerError(f"engine numbered external file {index}, expected {expected}")
        self._engine = engine
        self._error: StreamerError | None = None

    @property
    def error(self) -> StreamerError | None:
        return self._error

    def credit(self, block: native.Block) -> bool:
        """Reports ``block`` as landed; False once the run has stopped."""
        return self._engine.credit(block)

    def fail(self, error: StreamerError, block: native.Block) -> None:
        """Stops the run with ``error`` (the first one wins); the run's waiter wakes and raises it."""
        if self._error is None:
            self._error = error
        self._engine.fail(
            native.ErrorInfo(
                native.ERR_EXTERNAL, 0, block.file, block.acc_begin, block.acc_end - block.acc_begin, 0
            )
        )


def tensor_at(tensors: Named, engine_file: int, position: int) -> str | None:
    """The tensor holding byte ``position`` of an engine file, or the next one after it."""
    in_file = [(unit.end, name) for unit, name in tensors if unit.file == engine_file]
    found = bisect.bisect_right([end for end, _ in in_file], position)
    return in_file[found][1] if found < len(in_file) else None

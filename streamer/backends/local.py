"""Local files: resolved by ``sources.local``, read by the native engine's own reader threads.

Each file of a run is opened by the engine, with O_DIRECT when the page cache does not hold the
bytes the run reads (auto mode samples residency) and buffered when it does.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from streamer.backends.base import (
    LOCAL_CACHED_READ_COST,
    LOCAL_READ_COST,
    Delivery,
    Extent,
    Feed,
    FileIdentity,
    FileRead,
    Front,
    Named,
    Opened,
    Range,
    ReadCost,
    Storage,
    StoredFile,
)
from streamer.backends.sources import SourceLike, resolve
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.engine import native
from streamer.errors import SourceError, StreamerError
from streamer.format.safetensors import LOCAL_FRONT_BYTES, read_front, read_range

_CACHED_FRACTION = 0.5  # auto mode reads a file buffered when at least this much of it is cached
_RESIDENCY_SAMPLE = 16  # auto mode looks at one MiB in 16: ~1 ms per GiB instead of ~15
# A group's identity check (``identify``): blocks hashed per file, read by a few threads.
_SAMPLES = 32
_SAMPLE_BYTES = 4096
_IDENTIFY_THREADS = 8
_HASH_READ_BYTES = 8 << 20
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


class LocalFile(NamedTuple):
    path: str
    size: int


class LocalStorage(Storage):
    """The local file system; holds nothing open between runs."""

    delivery = Delivery.ENGINE_READS
    read_cost = LOCAL_READ_COST

    def __init__(self, config: StreamerConfig) -> None:
        self._config = config

    def reads_in_flight(self, config: StreamerConfig) -> int:
        return config.readers() * config.block_size

    def open(self, source: SourceLike) -> Opened:
        resolved = resolve(source)
        fronts = []
        for path in resolved.paths:
            data, size = read_front(path, LOCAL_FRONT_BYTES)
            fronts.append(Front(LocalFile(path, size), data))
        return Opened(resolved, tuple(fronts))

    def read_ranges(self, ranges: Sequence[Range]) -> list[bytes]:
        return [read_range(file.path, begin, end) for file, begin, end in ranges]

    def read_cost_of(self, file: StoredFile, span: Extent) -> ReadCost:
        """Requests cost little from the page cache, several times more from the device."""
        return LOCAL_READ_COST if wants_direct(self._config, file.path, span) else LOCAL_CACHED_READ_COST

    def close(self) -> None:
        """Nothing to release: the engine opens a run's files and closes them with the run."""

    def identify(self, files: Sequence[StoredFile], *, full: bool) -> list[FileIdentity]:
        """Each file's place (the host's boot, device, inode, modification time) and a SHA-256 of
        sampled blocks, or of every byte if ``full``; files at once (cold, the samples are
        random reads)."""
        boot = _boot_id()
        with ThreadPoolExecutor(max(1, min(_IDENTIFY_THREADS, len(files)))) as pool:
            return list(pool.map(lambda file: _identify(file.path, boot, full), files))

    def feed(
        self, engine: native.Engine, files: Sequence[StoredFile], spans: Sequence[Extent], tensors: Named
    ) -> Feed:
        return _EngineFeed(engine, self._config, files, spans)


class _EngineFeed(Feed):
    """The engine reads the blocks itself: this feed only opens the files and passes blocks on."""

    def __init__(
        self,
        engine: native.Engine,
        config: StreamerConfig,
        files: Sequence[StoredFile],
        spans: Sequence[tuple[int, int]],
    ) -> None:
        self._engine = engine
        self._direct = self._buffered = 0
        self._file_reads: list[FileRead] = []
        for expected, (file, span) in enumerate(zip(files, spans, strict=True)):
            try:
                index, direct = engine.add_file(file.path, wants_direct(config, file.path, span))
            except OSError as exc:
                # EINVAL: not a regular file any more (a FIFO or directory put in its place)
                reason = "not a regular file" if exc.errno == errno.EINVAL else exc.strerror
                raise SourceError(f"cannot open: {reason}", path=file.path) from None
            if index != expected:
                raise StreamerError(f"engine numbered file {index}, expected {expected}", path=file.path)
            if direct:
                self._direct += 1
            else:
                self._buffered += 1
            self._file_reads.append(FileRead.DIRECT if direct else FileRead.BUFFERED)

    @property
    def file_reads(self) -> Sequence[FileRead]:
        return self._file_reads

    def submit(self, blocks: Sequence[native.Block]) -> None:
        self._engine.submit(blocks)

    def stats(self) -> dict[str, int]:
        return {"direct_files": self._direct, "buffered_files": self._buffered}

    def close(self) -> None:
        """Nothing to stop: the engine's readers are joined when the engine closes."""


def _boot_id() -> str:
    try:
        with open(_BOOT_ID) as file:
            return file.read().strip()
    except OSError:
        return ""  # no place identity: ranks compare content alone


def _identify(path: str, boot: str, full: bool) -> FileIdentity:
    import hashlib  # OpenSSL's ~60 ms import, for group loads only

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block
    except OSError as exc:
        raise SourceError(f"cannot open: {exc.strerror}", path=path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SourceError("cannot open: not a regular file", path=path)
        place = f"{boot}:{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}" if boot else ""
        digest = hashlib.sha256()
        buffer = bytearray(min(info.st_size, _HASH_READ_BYTES))
        for offset, length in [(0, info.st_size)] if full else _samples(info.st_size):
            end = offset + length
            while offset < end:
                got = os.preadv(fd, [memoryview(buffer)[: min(len(buffer), end - offset)]], offset)
                if got <= 0:
                    break  # the file ended early: its size in the identity tells
                digest.update(memoryview(buffer)[:got])
                offset += got
        return FileIdentity(place, digest.hexdigest())
    except OSError as exc:
        raise SourceError(f"cannot read: {exc.strerror}", path=path) from None
    finally:
        os.close(fd)


def _samples(size: int) -> list[tuple[int, int]]:
    """``_SAMPLES`` blocks spread evenly over a file of ``size`` bytes, the first and last among
    them; the whole file when it is not larger than they are."""
    if size <= _SAMPLES * _SAMPLE_BYTES:
        return [(0, size)]
    step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
    return [(number * step, _SAMPLE_BYTES) for number in range(_SAMPLES - 1)] + [
        (size - _SAMPLE_BYTES, _SAMPLE_BYTES)
    ]


def wants_direct(config: StreamerConfig, path: str, span: tuple[int, int]) -> bool:
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

"""A second storage, for the tests: local files served the way an object store serves them, with
faults injected on request. It is the proof that a storage is one module: everything it needs
comes from ``streamer.backends.base``.

Sources are ``faulty://<local path>`` (a file, a directory or an ``*.index.json``, resolved by the
local rules). Headers are read through the contract's fronts and ranges; blocks are read by a
pool of Python threads (``os.preadv`` straight into the run's buffers) and credited to the
engine, as the S3 feeder does. ``Faults`` decides what goes wrong.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from streamer.backends.base import (
    Extent,
    ExternalFeed,
    Front,
    Named,
    Opened,
    Range,
    Storage,
    StoredFile,
    tensor_at,
)
from streamer.backends.sources import SourceLike, resolve
from streamer.engine import native
from streamer.errors import ReadError, SourceError, StreamerError

SCHEME = "faulty"
_PREFIX = f"{SCHEME}://"


@dataclass
class Faults:
    """What goes wrong; counted over the data reads of one storage (not the header reads)."""

    delay: float = 0.0  # seconds each block read waits first (a slow store)
    short_reads: bool = False  # every read returns at most half of what was asked (the rest is re-read)
    fail_after: int | None = None  # bytes served before every further read fails with EIO
    vanish_after: int | None = None  # bytes served before the object is gone (deleted mid-load)


@dataclass(frozen=True)
class FaultyFile:
    path: str
    size: int


def local_path(text: str) -> str:
    return text.removeprefix(_PREFIX)


class FaultyStorage(Storage):
    def __init__(self, faults: Faults, *, workers: int = 4) -> None:
        self.faults = faults
        self._workers = workers
        self._served = 0
        self._lock = threading.Lock()

    def open(self, source: SourceLike) -> Opened:
        if isinstance(source, (str, os.PathLike)):
            resolved = resolve(local_path(os.fspath(source)))
        else:
            resolved = resolve([local_path(os.fspath(s)) for s in source])
        fronts = []
        for path in resolved.paths:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                fronts.append(Front(FaultyFile(path, size), file.read(min(size, 4096))))
        return Opened(resolved, tuple(fronts))

    def read_ranges(self, ranges: Sequence[Range]) -> list[bytes]:
        out = []
        for file, begin, end in ranges:
            with open(file.path, "rb") as handle:
                handle.seek(begin)
                out.append(handle.read(end - begin))
        return out

    def feed(
        self, engine: native.Engine, files: Sequence[StoredFile], spans: Sequence[Extent], tensors: Named
    ) -> _FaultyFeed:
        return _FaultyFeed(self, engine, files, tensors)

    def close(self) -> None:
        """Nothing is held between runs."""

    def take(self, nbytes: int) -> int:
        """Counts ``nbytes`` as served; the bytes served before them."""
        with self._lock:
            before = self._served
            self._served += nbytes
            return before


class _FaultyFeed(ExternalFeed):
    def __init__(
        self, storage: FaultyStorage, engine: native.Engine, files: Sequence[StoredFile], tensors: Named
    ) -> None:
        super().__init__(engine, len(files))
        self._storage = storage
        self._paths = [f.path for f in files]
        self._tensors = tensors
        self._fds: list[int] = []
        self._stop = threading.Event()
        self._futures: list[Future[None]] = []
        self._reads = self._rereads = 0
        try:
            for path in self._paths:
                try:
                    self._fds.append(os.open(path, os.O_RDONLY))
                except OSError as exc:
                    raise SourceError(f"cannot open: {exc.strerror}", path=path) from None
        except BaseException:
            self._close_files()
            raise
        self._pool = ThreadPoolExecutor(storage._workers, thread_name_prefix="faulty-storage")

    def submit(self, blocks: Sequence[native.Block]) -> None:
        for block in blocks:
            self._futures.append(self._pool.submit(self._serve, block))

    def _serve(self, block: native.Block) -> None:
        if self._stop.is_set() or self.error is not None:
            return
        faults = self._storage.faults
        if faults.delay and self._stop.wait(faults.delay):
            return
        begin, end = block.acc_begin, block.acc_end
        view = native.writable_view(block.dst + (begin - block.read_offset), end - begin)
        try:
            self._read(block.file, begin, view)
        except StreamerError as error:
            self.fail(error, block)
            return
        except Exception as exc:  # a bug must still end the run, never hang it
            self.fail(self._error_at(block.file, begin, f"unexpected failure: {exc!r}"), block)
            return
        finally:
            view.release()
        self.credit(block)

    def _read(self, file: int, begin: int, view: memoryview) -> None:
        faults = self._storage.faults
        done = 0
        while done < len(view):
            want = len(view) - done
            if faults.short_reads and want > 1:
                want //= 2
            served = self._storage.take(want)
            if faults.vanish_after is not None and served + want > faults.vanish_after:
                raise self._error_at(file, begin + done, "the object vanished during the load")
            if faults.fail_after is not None and served + want > faults.fail_after:
                raise self._error_at(file, begin + done, f"read failed: {os.strerror(errno.EIO)}")
            self._reads += 1
            got = os.preadv(self._fds[file], [view[done : done + want]], begin + done)
            if got == 0:
                raise self._error_at(file, begin + done, "the object ended early")
            if done + got < len(view):
                self._rereads += 1
            done += got

    def _error_at(self, file: int, offset: int, message: str) -> ReadError:
        tensor = tensor_at(self._tensors, file, offset)
        return ReadError(message, path=self._paths[file], tensor=tensor, offset=offset)

    def stats(self) -> dict[str, int]:
        return {"requests": self._reads, "retries": self._rereads}

    def close(self) -> None:
        """Drops what has not started, waits for reads in flight, closes the files. Idempotent."""
        self._stop.set()
        for future in self._futures:
            future.cancel()
        self._pool.shutdown(wait=True)
        self._close_files()

    def _close_files(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

"""The cache directory: one file per cached chunk of an object, checked on every read.

Layout: ``<dir>/v1/<identity>/<index>.chunk`` where ``identity`` hashes the object's endpoint,
bucket, key, size and ETag (a replaced object is another directory: a miss, never stale bytes)
and ``index`` is the chunk's place on a fixed grid of object offsets. A chunk file is a 32-byte
head (magic, offset, length, xxh3_64 of the data) and the data. It is written to a temporary
name, fsynced, and renamed into place, so a crash or a full disk leaves at most a temporary file,
never a visible torn chunk; every read checks length and checksum, and a chunk that fails is
deleted and counted. There is no index file: what is on disk is the index (scanned at open).

Processes of a node share the directory without a daemon: ``<index>.lock`` files held with
``flock`` (per open file description, so threads of one process exclude each other too) make
one of them fill a chunk while the others wait for it. LRU eviction uses the chunk files'
mtimes (a hit touches its file). A directory that cannot be written (read-only, full disk)
turns writing off with one warning; loads go on from S3.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import struct
import threading
import time
import warnings

import xxhash

_MAGIC = b"STRMCH01"
_HEAD = struct.Struct("<8sQQQ")  # magic, object offset, length, xxh3_64 of the data
_SUFFIX = ".chunk"
_TMP = ".tmp."
_WAIT_STEP = 0.002  # seconds between tries of a lock another process holds


class CacheWarning(RuntimeWarning):
    """The cache could not be used (read-only or full directory); the load goes on without it."""


def identity(endpoint: str | None, bucket: str, key: str, size: int, etag: str | None) -> str:
    """The directory name of one version of an object."""
    text = "\0".join((endpoint or "", bucket, key, str(size), etag or ""))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ChunkLock:
    """An exclusive ``flock`` on one chunk, across the processes (and threads) of a node."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlocks (closing the descriptor drops the lock). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class ChunkStore:
    """The cache directory ``root`` holding at most ``max_bytes`` of chunk data."""

    def __init__(self, root: str, max_bytes: int) -> None:
        self._root = os.path.join(root, "v1")
        self._max_bytes = max_bytes
        self._mutex = threading.Lock()
        self._writable = True
        self._warned = False
        self.errors = 0  # chunks that failed their check (deleted, refetched)
        try:
            os.makedirs(self._root, exist_ok=True)
        except OSError as error:
            self._disable(error)
        self._used = self._scan()

    @property
    def writable(self) -> bool:
        return self._writable

    def _path(self, ident: str, index: int) -> str:
        return os.path.join(self._root, ident, f"{index}{_SUFFIX}")

    def read(self, ident: str, index: int, offset: int, length: int) -> bytes | None:
        """The chunk's data if it is cached and intact; a chunk that fails its check is deleted."""
        path = self._path(ident, index)
        try:
            with open(path, "rb") as file:
                raw = file.read(_HEAD.size + length + 1)
        except OSError:
            return None
        if len(raw) == _HEAD.size + length:
            magic, got_offset, got_length, digest = _HEAD.unpack_from(raw)
            data = raw[_HEAD.size :]
            if (magic, got_offset, got_length) == (_MAGIC, offset, length) and xxhash.xxh3_64_intdigest(
                data
            ) == digest:
                with contextlib.suppress(OSError):
                    os.utime(path)  # LRU: most recently used
                return data
        try:
            os.unlink(path)  # whoever removes it counts it (two readers of one bad chunk: one error)
        except OSError:
            return None
        with self._mutex:
            self.errors += 1
        return None

    def lock(self, ident: str, index: int, wait: float) -> ChunkLock | None:
        """The chunk's lock, waiting up to ``wait`` seconds for another filler; None when the
        wait ran out or the directory cannot hold lock files."""
        if not self._writable:
            return None
        directory = os.path.join(self._root, ident)
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(
                os.path.join(directory, f"{index}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644
            )
        except OSError as error:
            self._disable(error)
            return None
        until = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return ChunkLock(fd)
            except BlockingIOError:
                if time.monotonic() >= until:
                    os.close(fd)
                    return None
                time.sleep(_WAIT_STEP)
            except OSError as error:
                os.close(fd)
                self._disable(error)
                return None

    def write(self, ident: str, index: int, offset: int, data: bytes | bytearray) -> bool:
        """Stores a chunk durably (temp file, fsync, rename); False when it was not stored."""
        if not self._writable or len(data) > self._max_bytes:
            return False
        path = self._path(ident, index)
        temporary = f"{path}{_TMP}{os.getpid()}.{threading.get_ident()}"
        head = _HEAD.pack(_MAGIC, offset, len(data), xxhash.xxh3_64_intdigest(data))
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, head)
                _write_all(fd, memoryview(data))
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            self._disable(error)
            return False
        with self._mutex:
            self._used += _HEAD.size + len(data)
            over = self._used > self._max_bytes
        if over:
            self.evict()
        return True

    def evict(self) -> None:
        """Deletes the least recently used chunks until the directory holds at most ``max_bytes``."""
        chunks = sorted((mtime, size, path) for path, size, mtime in self._chunks())
        used = sum(size for _, size, _ in chunks)
        for _, size, path in chunks:
            if used <= self._max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            used -= size
        with self._mutex:
            self._used = used

    def _scan(self) -> int:
        """Bytes cached now; removes temporary files of processes that no longer run (kill -9)."""
        return sum(size for _, size, _ in self._chunks(clean=True))

    def _chunks(self, *, clean: bool = False) -> list[tuple[str, int, float]]:
        found = []
        try:
            directories = os.listdir(self._root)
        except OSError:
            return []
        for name in directories:
            directory = os.path.join(self._root, name)
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.name.endswith(_SUFFIX):
                        stat = entry.stat()
                        found.append((entry.path, stat.st_size, stat.st_mtime))
                    elif clean and _TMP in entry.name and not _alive(entry.name):
                        os.unlink(entry.path)
                except OSError:
                    continue
        return found

    def _disable(self, error: OSError) -> None:
        """Turns writing off with one warning (read-only directory, full disk, ...)."""
        with self._mutex:
            self._writable = False
            if self._warned:
                return
            self._warned = True
        reason = errno.errorcode.get(error.errno or 0, "error")
        warnings.warn(
            f"streamer cache {os.path.dirname(self._root)!r} cannot be written ({reason}: {error.strerror}); "
            "loading without caching",
            CacheWarning,
            stacklevel=2,
        )


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _alive(temporary_name: str) -> bool:
    """Whether the process that named this temporary file (``...tmp.<pid>.<thread>``) still runs."""
    try:
        pid = int(temporary_name.rsplit(_TMP, 1)[1].split(".")[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True

"""The cache directory: one file per cached chunk of an object, checked on every read.

Layout: ``<dir>/v3/<identity>/<index>.chunk`` where ``identity`` is the SHA-256 of the object's
endpoint, bucket, key, size and ETag (a replaced object is another directory: a miss, never stale
bytes) and ``index`` is the chunk's place on a fixed grid of object offsets. A chunk file is a head
of ``HEAD_BYTES`` (magic, the object's identity, offset, length, piece size, the xxh3_64 of every
piece of the data, and the xxh3_64 of all that) and the data, which starts on a
``native.DIRECT_ALIGNMENT`` boundary so hits are read like local checkpoint files: O_DIRECT,
straight into the run's buffers.

Every piece a read touches is checked before the read returns, so a bad piece is never handed
on: a block needing part of a chunk reads and checks only the pieces under it. A chunk that
fails (torn, truncated, flipped bit, the head of another object or offset: a file swapped or
renamed on disk) is deleted and counted; its reader fetches it again. Writes go to a temporary
name renamed into place, so readers never see a half-written chunk; there is no fsync per chunk:
a chunk whose data did not reach the disk before a crash fails its checksums and is fetched
again, which is what an fsync would have bought, without stalling the writer on the device.
There is no index file: what is on disk is the index (scanned at open, when temporary files of
dead processes are removed).

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
import mmap
import os
import struct
import threading
import time
import warnings

import xxhash

from streamer.engine import native
from streamer.host.safedir import Access

STORE_DIR = "v3"
_MAGIC = b"STRMCH03"
# magic, object identity (SHA-256), object offset, length, piece bytes, xxh3_64 of the head
_FIXED = struct.Struct("<8s32sQQQQ")
HEAD_BYTES = native.DIRECT_ALIGNMENT
_MAX_PIECES = (HEAD_BYTES - _FIXED.size) // 8
_MIN_PIECE = 16 << 10  # fewer, larger pieces: one checksum call per piece is Python overhead
_SUFFIX = ".chunk"
_TMP = ".tmp."
_WAIT_STEP = 0.002  # seconds between tries of a lock another process holds


def piece_bytes(chunk_bytes: int) -> int:
    """The checksummed piece of a chunk: at most 128 of them, each a multiple of 4 KiB."""
    alignment = native.DIRECT_ALIGNMENT
    wanted = max(_MIN_PIECE, -(-chunk_bytes // 128))
    return -(-wanted // alignment) * alignment


class CacheWarning(RuntimeWarning):
    """The cache could not be used (another user's, read-only or full directory); the load goes on
    without it."""


def identity(place: str | None, bucket: str, key: str, size: int, version: str | None) -> str:
    """One version of an object: the SHA-256 (hex) of what names it (the store's place, bucket,
    key, size, ETag or generation); its chunks' directory name."""
    return hashed_name(place or "", bucket, key, str(size), version or "")


def hashed_name(*parts: str) -> str:
    """A file name standing for ``parts`` (joined by NUL, which no part holds): their SHA-256."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class ChunkBuffer:
    """Page-aligned memory for a chunk of up to ``capacity`` bytes, for a chunk that no single
    block of the run holds whole: the fill lands here, the blocks copy their parts out, and it is
    written (O_DIRECT) from here. Feeds reuse them: fresh memory costs a zeroing fault per page."""

    def __init__(self, capacity: int) -> None:
        self.length = capacity
        # Private: Python's default anonymous map is shared memory, which THP leaves in 4 KiB pages.
        self._memory = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):
            self._memory.madvise(mmap.MADV_HUGEPAGE)

    @property
    def data(self) -> memoryview:
        """The chunk's ``length`` bytes."""
        return memoryview(self._memory)[: self.length]


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
    """The cache directory ``root`` holding at most ``max_bytes`` of chunk data; its directories
    and files are made with ``access``."""

    def __init__(self, root: str, max_bytes: int, access: Access) -> None:
        self._root = os.path.join(root, STORE_DIR)
        self._max_bytes = max_bytes
        self._access = access
        self._mutex = threading.Lock()
        self._landing = threading.Lock()  # chunks renamed into place and evictions, one at a time
        self._writable = True
        self._direct = hasattr(os, "O_DIRECT")
        self._warned = False
        self.errors = 0  # chunks that failed their check (deleted, refetched)
        self.evictions = 0  # chunks deleted to stay within max_bytes
        try:
            access.make(self._root)
        except OSError as error:
            self._disable(error)
        self._used = self._scan()

    @property
    def writable(self) -> bool:
        return self._writable

    def _path(self, ident: str, index: int) -> str:
        return os.path.join(self._root, ident, f"{index}{_SUFFIX}")

    def read_into(self, ident: str, index: int, offset: int, length: int, low: int, out: memoryview) -> bool:
        """Fills ``out`` with the object's bytes ``[low, low + len(out))`` from chunk ``index``
        (object bytes ``[offset, offset + length)``), every piece under them checked; False when
        the chunk is not cached or fails a check (it is then deleted, and ``out`` may hold junk)."""
        path = self._path(ident, index)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            intact = self._read_checked(fd, ident, offset, length, low - offset, out)
        except OSError:
            intact = False
        finally:
            os.close(fd)
        if intact:
            with contextlib.suppress(OSError):
                os.utime(path)  # LRU: most recently used
            return True
        try:
            os.unlink(path)  # whoever removes it counts it (two readers of one bad chunk: one error)
        except OSError:
            return False
        with self._mutex:
            self.errors += 1
        return False

    def _read_checked(
        self, fd: int, ident: str, offset: int, length: int, start: int, out: memoryview
    ) -> bool:
        head = os.pread(fd, HEAD_BYTES, 0)
        if len(head) != HEAD_BYTES or os.fstat(fd).st_size != HEAD_BYTES + length:
            return False
        magic, owner, got_offset, got_length, piece, head_digest = _FIXED.unpack_from(head)
        if (magic, owner, got_offset, got_length) != (
            _MAGIC,
            bytes.fromhex(ident),
            offset,
            length,
        ) or piece <= 0:
            return False
        count = -(-length // piece)
        if count > _MAX_PIECES:
            return False
        digests = struct.unpack_from(f"<{count}Q", head, _FIXED.size)
        fixed = _FIXED.pack(magic, owner, offset, length, piece, 0)
        if xxhash.xxh3_64_intdigest(fixed + head[_FIXED.size : _FIXED.size + 8 * count]) != head_digest:
            return False
        end = start + len(out)
        first, last = start // piece, (end - 1) // piece  # the pieces under [start, end)
        inner_first = first if start == first * piece else first + 1
        inner_end = last + 1 if end == min((last + 1) * piece, length) else last
        for edge in sorted(p for p in {first, last} if not inner_first <= p < inner_end):
            begin = edge * piece
            data = os.pread(fd, min(piece, length - begin), HEAD_BYTES + begin)
            if len(data) != min(piece, length - begin) or xxhash.xxh3_64_intdigest(data) != digests[edge]:
                return False
            low, high = max(start, begin), min(end, begin + len(data))
            out[low - start : high - start] = data[low - begin : high - begin]
        if inner_first < inner_end:
            begin, stop = inner_first * piece, min(inner_end * piece, length)
            inner = out[begin - start : stop - start]
            if not self._read_exact(fd, inner, HEAD_BYTES + begin):
                return False
            for number in range(inner_first, inner_end):
                low = number * piece - begin
                if xxhash.xxh3_64_intdigest(inner[low : low + piece]) != digests[number]:
                    return False
        return True

    def _read_exact(self, fd: int, out: memoryview, position: int) -> bool:
        """Reads ``len(out)`` bytes at ``position``: O_DIRECT where it can (no page-cache copy,
        like local checkpoint files), buffered for the rest."""
        done = self._read_direct(fd, out, position)
        done += _read_all(fd, out[done:], position + done)
        return done == len(out)

    def _read_direct(self, fd: int, out: memoryview, position: int) -> int:
        """Bytes of the front of ``out`` read with O_DIRECT (see ``_direct_bytes``)."""
        aligned = self._direct_bytes(out)
        direct_fd = self._reopen_direct(fd, os.O_RDONLY) if aligned else None
        if direct_fd is None:
            return 0
        try:
            return _read_all(direct_fd, out[:aligned], position)
        except OSError:
            return 0  # read it all buffered
        finally:
            os.close(direct_fd)

    def _direct_bytes(self, data: memoryview) -> int:
        """How much of the front of ``data`` O_DIRECT can move: its aligned part, when its memory
        is aligned and the file system has not refused O_DIRECT."""
        alignment = native.DIRECT_ALIGNMENT
        aligned = len(data) - len(data) % alignment
        if not (self._direct and aligned) or native.address(native.ffi.from_buffer(data)) % alignment:
            return 0
        return aligned

    def _reopen_direct(self, fd: int, flags: int) -> int | None:
        """``fd``'s file opened again with O_DIRECT; None where the file system refuses it (tmpfs),
        which turns O_DIRECT off for this store."""
        try:
            return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC | os.O_DIRECT)
        except OSError:
            self._direct = False
            return None

    def lock(
        self, ident: str, index: int, wait: float, stop: threading.Event | None = None
    ) -> ChunkLock | None:
        """The chunk's lock, waiting up to ``wait`` seconds for another filler (or until ``stop``
        is set); None when the wait ended or the directory cannot hold lock files."""
        if not self._writable:
            return None
        directory = os.path.join(self._root, ident)
        try:
            self._access.make(directory)
            fd = self._access.create(os.path.join(directory, f"{index}.lock"), os.O_RDWR)
        except OSError as error:
            self._disable(error)
            return None
        until = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return ChunkLock(fd)
            except BlockingIOError:
                if time.monotonic() >= until or (stop is not None and stop.is_set()):
                    os.close(fd)
                    return None
                time.sleep(_WAIT_STEP)
            except OSError as error:
                os.close(fd)
                self._disable(error)
                return None

    def write(self, ident: str, index: int, offset: int, data: memoryview, piece: int) -> bool:
        """Stores ``data`` as chunk ``index`` (object bytes from ``offset``), checksummed in pieces
        of ``piece`` bytes, under a temporary name renamed into place; False when it was not
        stored. ``data`` may be the run's own buffer: it is only read, and not kept."""
        length = len(data)
        if not self._writable or HEAD_BYTES + length > self._max_bytes:
            return False
        path = self._path(ident, index)
        temporary = f"{path}{_TMP}{os.getpid()}.{threading.get_ident()}"
        digests = [xxhash.xxh3_64_intdigest(data[at : at + piece]) for at in range(0, length, piece)]
        if len(digests) > _MAX_PIECES:
            raise ValueError(f"{len(digests)} pieces of {piece} bytes do not fit a chunk head")
        table = struct.pack(f"<{len(digests)}Q", *digests)
        owner = bytes.fromhex(ident)
        head_digest = xxhash.xxh3_64_intdigest(_FIXED.pack(_MAGIC, owner, offset, length, piece, 0) + table)
        head = (_FIXED.pack(_MAGIC, owner, offset, length, piece, head_digest) + table).ljust(
            HEAD_BYTES, b"\0"
        )
        try:
            self._access.make(os.path.dirname(path))
            fd = self._access.create(temporary, os.O_WRONLY | os.O_TRUNC)
            try:
                _write_all(fd, head, 0)
                done = self._write_direct(fd, data, HEAD_BYTES)
                _write_all(fd, data[done:], HEAD_BYTES + done)
            finally:
                os.close(fd)
            with self._landing:
                os.replace(temporary, path)
                self._used += HEAD_BYTES + length
                if self._used > self._max_bytes:
                    self._evict()
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            self._disable(error)
            return False
        return True

    def _write_direct(self, fd: int, data: memoryview, position: int) -> int:
        """Bytes of the front of ``data`` written with O_DIRECT (see ``_direct_bytes``): no
        page-cache copy, no dirty pages for later loads to wait behind."""
        aligned = self._direct_bytes(data)
        direct_fd = self._reopen_direct(fd, os.O_WRONLY) if aligned else None
        if direct_fd is None:
            return 0
        try:
            _write_all(direct_fd, data[:aligned], position)
        finally:
            os.close(direct_fd)
        return aligned

    def _evict(self) -> None:
        """Deletes the least recently used chunks until the directory holds at most ``max_bytes``.
        Called with ``_landing`` held: a chunk renamed into place during the scan would be
        neither seen nor counted, and the directory would outgrow the bound."""
        chunks = sorted((mtime, size, path) for path, size, mtime in self._chunks())
        used = sum(size for _, size, _ in chunks)
        for _, size, path in chunks:
            if used <= self._max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                self.evictions += 1
            used -= size
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
                    elif clean and _TMP in entry.name and not writer_alive(entry.name):
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


def _read_all(fd: int, out: memoryview, position: int) -> int:
    """Bytes read into ``out`` from ``position``, fewer only at the end of the file."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], position + done)
        if got <= 0:
            break
        done += got
    return done


def _write_all(fd: int, data: bytes | memoryview, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view = view[written:]
        position += written


def writer_alive(temporary_name: str) -> bool:
    """Whether the process that named this temporary file (``...tmp.<pid>.<thread>``) still runs."""
    try:
        pid = int(temporary_name.rsplit(_TMP, 1)[1].split(".")[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True

"""cffi binding of the C engine (``native/``), loaded in ABI mode with ``dlopen``.

The C library has no Python dependency; this module is the only place that
knows its symbols. They come from the C header (installed beside the library):
parsed once by cffi into ``_ffi.py`` (``scripts/emit_ffi.py``, so no import
parses C), which is refused if the header's bytes changed since; a library
built from another version of the header is refused when it is loaded. cffi
releases the GIL around every call, so a blocking ``wait`` lets other Python
threads run.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from streamer.engine import _ffi

# Re-exported: the runs build their work items as native.Block / native.Unit.
from streamer.engine.blocks import BLOCK_DTYPE
from streamer.engine.blocks import Block as Block
from streamer.engine.blocks import BlockArray as BlockArray
from streamer.engine.blocks import Unit as Unit
from streamer.engine.declarations import HEADER_NAME, header_path

_LIBRARY_NAME = "libstreamer_engine.so"
_ALL = 2**64 - 1  # a length meaning "to the end of the file"


def _check_header() -> None:
    """The installed header must be the one ``_ffi.py`` was made from, byte for byte."""
    path = header_path()
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as error:
        raise ImportError(
            f"streamer's engine header is unreadable at {path} ({error}): reinstall the package"
        ) from error
    if digest != _ffi.HEADER_SHA256:
        raise ImportError(
            f"{HEADER_NAME} differs from the header streamer/engine/_ffi.py was made from: "
            "run `python scripts/emit_ffi.py` and rebuild"
        )


_check_header()
_CONSTANTS: Mapping[str, int] = _ffi.CONSTANTS

ABI_VERSION = _CONSTANTS["SE_ABI_VERSION"]
DIRECT_ALIGNMENT = _CONSTANTS["SE_DIRECT_ALIGNMENT"]
OK = _CONSTANTS["SE_OK"]
ERR_NOMEM = _CONSTANTS["SE_ERR_NOMEM"]
ERR_OPEN = _CONSTANTS["SE_ERR_OPEN"]
ERR_READ = _CONSTANTS["SE_ERR_READ"]
ERR_TRUNCATED = _CONSTANTS["SE_ERR_TRUNCATED"]
ERR_CANCELLED = _CONSTANTS["SE_ERR_CANCELLED"]
ERR_INVALID = _CONSTANTS["SE_ERR_INVALID"]
ERR_THREAD = _CONSTANTS["SE_ERR_THREAD"]
ERR_EXTERNAL = _CONSTANTS["SE_ERR_EXTERNAL"]
ERR_FILL = _CONSTANTS["SE_ERR_FILL"]
BLOCK_FILL = _CONSTANTS["SE_BLOCK_FILL"]
FILL_CHUNK = _CONSTANTS["SE_FILL_CHUNK"]
FILL_DIRECT_CHUNK = _CONSTANTS["SE_FILL_DIRECT_CHUNK"]

ffi = _ffi.ffi
_BLOCK_FIELDS: Mapping[str, tuple[Any, ...]] = BLOCK_DTYPE.fields or {}
if ffi.sizeof("se_block") != BLOCK_DTYPE.itemsize or any(
    ffi.offsetof("se_block", name) != _BLOCK_FIELDS[name][1] for name in Block._fields
):
    raise ImportError(f"{HEADER_NAME}: se_block's layout differs from streamer.engine.blocks.BLOCK_DTYPE")


@functools.cache
def _lib() -> Any:
    """Loads the engine once; ``STREAMER_NATIVE_LIB`` points a developer build at another copy."""
    override = os.environ.get("STREAMER_NATIVE_LIB")
    path = Path(override) if override else Path(__file__).resolve().parent.parent / "_native" / _LIBRARY_NAME
    if not path.is_file():
        raise ImportError(
            f"streamer's native engine is missing at {path}; install the package with `pip install .` "
            "(it builds native/ with CMake)"
        )
    lib = ffi.dlopen(str(path))
    try:
        built = lib.se_abi_version()
    except (AttributeError, ffi.error):  # built before the ABI had a version (a missing symbol)
        built = None
    if built != ABI_VERSION:
        raise ImportError(
            f"streamer's native engine at {path} has ABI version {built}, but this streamer expects "
            f"{ABI_VERSION}: it is a stale build; reinstall the package (or rebuild STREAMER_NATIVE_LIB)"
        )
    return lib


class EngineFailure(Exception):
    """A run failed inside the engine; the loader turns it into a named ``StreamerError``."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(f"engine status {info.code} (errno {info.sys_errno})")
        self.info = info


class ErrorInfo(NamedTuple):
    code: int
    sys_errno: int
    file: int
    offset: int
    expected: int
    got: int


def _fill_block(entry: Any, block: Block) -> None:
    entry.file = block.file
    entry.first_unit = block.first_unit
    entry.last_unit = block.last_unit
    entry.acc_begin = block.acc_begin
    entry.acc_end = block.acc_end
    entry.read_offset = block.read_offset
    entry.read_length = block.read_length
    entry.dst = ffi.cast("void *", block.dst)
    entry.flags = block.flags


def _raise_status(status: int, what: str) -> None:
    if status == ERR_NOMEM:
        raise MemoryError(f"{what}: out of memory")
    if status == ERR_THREAD:
        raise RuntimeError(f"{what}: could not start a reader thread")
    raise ValueError(f"{what}: engine status {status}")


class Engine:
    """A pool of reader threads for one run. ``close()`` joins them and closes files."""

    def __init__(self, n_workers: int, units: Sequence[Unit]) -> None:
        lib = _lib()
        table = ffi.new("se_unit[]", max(len(units), 1))
        for i, unit in enumerate(units):
            table[i].file = unit.file
            table[i].begin = unit.begin
            table[i].end = unit.end
            table[i].need = unit.need
        status = ffi.new("int32_t *")
        handle = lib.se_engine_create(n_workers, table, len(units), status)
        if handle == ffi.NULL:
            _raise_status(status[0], "creating the reader pool")
        self._lib = lib
        self._handle: Any = handle
        self._ids = ffi.new("uint32_t[]", 4096)
        self._n_out = ffi.new("size_t *")

    def add_file(self, path: str, want_direct: bool) -> tuple[int, bool]:
        """Opens ``path``; returns its index and whether O_DIRECT took effect. Raises OSError."""
        is_direct = ffi.new("int32_t *")
        sys_errno = ffi.new("int32_t *")
        index = self._lib.se_engine_add_file(
            self._handle, os.fsencode(path), int(want_direct), is_direct, sys_errno
        )
        if index == ERR_OPEN:
            raise OSError(sys_errno[0], os.strerror(sys_errno[0]), path)
        if index < 0:
            _raise_status(index, f"opening {path}")
        return int(index), bool(is_direct[0])

    def set_fill(self, fill: PageFill) -> None:
        """Lends the engine ``fill`` for its ``BLOCK_FILL`` blocks; it must stay open until ``close``."""
        status = self._lib.se_engine_set_fill(self._handle, fill.fd, fill.mapped_view_bytes)
        if status != OK:
            _raise_status(status, "lending the page fill")

    def add_external_file(self) -> int:
        """Registers a file whose blocks another reader fetches and reports with ``credit``."""
        index = self._lib.se_engine_add_external_file(self._handle)
        if index < 0:
            _raise_status(index, "adding an external file")
        return int(index)

    def credit(self, block: Block) -> bool:
        """Reports a block of an external file as read; False once the run has stopped.

        Safe from any thread while the engine is open (the caller keeps it open until its
        reader has stopped).
        """
        entry = ffi.new("se_block *")
        _fill_block(entry, block)
        status = self._lib.se_engine_credit(self._handle, entry)
        if status == ERR_INVALID:
            raise ValueError(f"engine refused the credited block {block}")
        return bool(status == OK)

    def fail(self, info: ErrorInfo) -> None:
        """Stops the run with ``info`` as its failure (unless it already failed); waiters wake."""
        entry = ffi.new("se_error_info *")
        entry.code = info.code
        entry.sys_errno = info.sys_errno
        entry.file = info.file
        entry.offset = info.offset
        entry.expected = info.expected
        entry.got = info.got
        status = self._lib.se_engine_fail(self._handle, entry)
        if status != OK:
            _raise_status(status, "reporting a failure")

    def submit(self, blocks: Sequence[Block]) -> None:
        if not blocks:
            return
        if isinstance(blocks, BlockArray):
            array = ffi.cast("se_block *", ffi.from_buffer(blocks.table))
        else:
            array = ffi.new("se_block[]", len(blocks))
            for i, block in enumerate(blocks):
                _fill_block(array[i], block)
        status = self._lib.se_engine_submit(self._handle, array, len(blocks))
        if status != OK:
            self._raise_failure(status)

    def wait(self, timeout_ms: int) -> list[int]:
        """Completed unit ids (empty on timeout); raises EngineFailure once the run failed."""
        status = self._lib.se_engine_wait(self._handle, self._ids, 4096, timeout_ms, self._n_out)
        if status != OK:
            self._raise_failure(status)
        return list(self._ids[0 : self._n_out[0]])

    def _raise_failure(self, status: int) -> None:
        info = ffi.new("se_error_info *")
        self._lib.se_engine_error(self._handle, info)
        code = info.code if info.code != OK else status
        raise EngineFailure(ErrorInfo(code, info.sys_errno, info.file, info.offset, info.expected, info.got))

    def stats(self) -> dict[str, float]:
        out = ffi.new("se_stats *")
        self._lib.se_engine_stats(self._handle, out)
        return {
            "bytes_read": out.bytes_read,
            "blocks_done": out.blocks_done,
            "bytes_filled": out.bytes_filled,
            "bytes_mapped": out.bytes_mapped,
            "read_seconds": out.read_seconds,
            "idle_seconds": out.idle_seconds,
        }

    def cancel(self) -> None:
        if self._handle is not None:
            self._lib.se_engine_cancel(self._handle)

    def close(self) -> None:
        """Waits for in-flight reads, joins the threads, closes the files. Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.se_engine_destroy(handle)


class PageFill:
    """Fresh pages created holding the bytes read into them (``se_fill_open``): no page fault, no
    zeroing. A registered page must not be touched until it is filled or unregistered.

    ``mapped_view_bytes``: how much of a file's mapping each reader keeps mapped, placing cached
    pages from it, before it unmaps them (``se_engine_set_fill``): resident memory on one side, a
    TLB flush on every core per unmapping on the other."""

    def __init__(self, fd: int, mapped_view_bytes: int) -> None:
        self.fd = fd
        self.mapped_view_bytes = mapped_view_bytes

    @classmethod
    def open(cls, mapped_view_bytes: int = FILL_CHUNK) -> tuple[PageFill | None, str]:
        """A page fill and "", or None and why not (the kernel or a seccomp filter refused)."""
        page = os.sysconf("SC_PAGE_SIZE")
        if page != DIRECT_ALIGNMENT:  # blocks are cut in 4 KiB pages
            return None, f"pages are {page} bytes, not {DIRECT_ALIGNMENT}"
        fd = ffi.new("int32_t *")
        sys_errno = ffi.new("int32_t *")
        if _lib().se_fill_open(fd, sys_errno) != OK:
            return None, f"userfaultfd refused: {os.strerror(sys_errno[0])}"
        return cls(int(fd[0]), mapped_view_bytes), ""

    def register(self, address: int, size: int) -> bool:
        """Makes the pages of ``[address, address + size)`` fillable; False where the kernel refuses."""
        sys_errno = ffi.new("int32_t *")
        return bool(_lib().se_fill_register(self.fd, ffi.cast("void *", address), size, sys_errno) == OK)

    def unregister(self, address: int, size: int) -> bool:
        """Makes the range plain memory again; False where the kernel refuses."""
        sys_errno = ffi.new("int32_t *")
        return bool(_lib().se_fill_unregister(self.fd, ffi.cast("void *", address), size, sys_errno) == OK)

    def close(self) -> None:
        """Closes the descriptor, which unregisters everything still registered. Idempotent."""
        fd, self.fd = self.fd, -1
        _lib().se_fill_close(fd)


# Smaller buffers keep 4 KiB pages (numpy's rule too): a huge page would be mostly waste.
HUGEPAGE_MIN_BYTES = 4 << 20


def read_pieces(
    pieces: Sequence[tuple[int, int, int, int]],
    buffers: Sequence[tuple[int, int]],
    n_threads: int,
    team: int | None,
) -> ErrorInfo | None:
    """Reads every piece ``(offset, fd, first buffer, buffer count)`` into its buffers ``(address,
    length)`` on ``n_threads`` threads: those of ``team`` (the address of a ``GOMP_parallel``) where
    given, else threads started and joined here. None, or the first failure (``file`` is the
    failing piece's index)."""
    piece_table = ffi.new("se_piece[]", len(pieces))
    for entry, (offset, fd, first, count) in zip(piece_table, pieces, strict=True):
        entry.offset, entry.fd, entry.first_buffer, entry.n_buffers = offset, fd, first, count
    buffer_table = ffi.new("se_buffer[]", len(buffers))
    for entry, (where, length) in zip(buffer_table, buffers, strict=True):
        entry.address, entry.length = where, length
    info = ffi.new("se_error_info *")
    runner = ffi.NULL if team is None else ffi.cast("se_team_fn", team)
    status = _lib().se_read_pieces(
        piece_table, len(pieces), buffer_table, len(buffers), n_threads, runner, info
    )
    if status == OK:
        return None
    if status in (ERR_INVALID, ERR_NOMEM):
        _raise_status(status, "reading pieces")
    return ErrorInfo(info.code, info.sys_errno, info.file, info.offset, info.expected, info.got)


def _huge(size: int, hugepages: bool) -> int:
    return int(hugepages and size >= HUGEPAGE_MIN_BYTES)


def allocate(size: int, hugepages: bool) -> Any:
    """Anonymous memory that nothing owns yet: pass it to ``own``, or to ``free``.

    ``hugepages``: advise transparent huge pages, for buffers of ``HUGEPAGE_MIN_BYTES`` or more.
    """
    pointer = _lib().se_alloc(size, _huge(size, hugepages))
    if pointer == ffi.NULL:
        raise MemoryError(f"cannot allocate {size} bytes of host memory")
    return pointer


def free(pointer: Any, size: int, hugepages: bool) -> None:
    """Unmaps memory from ``allocate``; ``size`` and ``hugepages`` as given to it."""
    _lib().se_free(pointer, size, _huge(size, hugepages))


def populate(address: int, size: int) -> bool:
    """Faults ``size`` bytes at ``address`` in without writing them (safe beside writers);
    False where the kernel cannot (older than Linux 5.14) or the range is not mapped."""
    sys_errno = ffi.new("int32_t *")
    return bool(_lib().se_populate(ffi.cast("void *", address), size, sys_errno) == OK)


def own(pointer: Any, size: int, release: Callable[[Any], None]) -> Any:
    """``pointer`` behind an owner that calls ``release(pointer)`` when it (and every buffer over it) dies."""
    return ffi.gc(pointer, release, size=size)


def as_buffer(memory: Any, size: int) -> Any:
    """A writable Python buffer over ``memory`` that keeps it alive."""
    return ffi.buffer(memory, size)


def writable_view(address: int, size: int) -> memoryview:
    """A writable view of ``size`` bytes at ``address``; the caller keeps the memory alive."""
    return memoryview(ffi.buffer(ffi.cast("char *", address), size))


def address(memory: Any) -> int:
    return int(ffi.cast("uintptr_t", memory))


def resident_bytes(
    path: str, sample_every: int = 1, offset: int = 0, length: int | None = None
) -> tuple[int, int]:
    """(bytes cached, bytes looked at) of ``[offset, offset + length)`` clipped to the file
    (``length`` None: to its end), or OSError; ``sample_every`` N > 1 estimates from every Nth MiB."""
    resident = ffi.new("uint64_t *")
    total = ffi.new("uint64_t *")
    sys_errno = ffi.new("int32_t *")
    span = _ALL if length is None else length
    status = _lib().se_resident_bytes(
        os.fsencode(path), offset, span, sample_every, resident, total, sys_errno
    )
    if status != OK:
        code = sys_errno[0]
        raise OSError(code, os.strerror(code) if code else f"engine status {status}", path)
    return int(resident[0]), int(total[0])


def crc32c(data: int | bytes, length: int = -1, crc: int = 0) -> int:
    """CRC-32C of ``length`` bytes at address ``data`` (or of the bytes ``data``), continuing ``crc``;
    the GIL is released while it runs."""
    if isinstance(data, bytes):
        return int(_lib().se_crc32c(crc, ffi.from_buffer(data), len(data)))
    return int(_lib().se_crc32c(crc, ffi.cast("const void *", data), length))


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32C of A followed by B, from theirs and B's length."""
    return int(_lib().se_crc32c_combine(crc_a, crc_b, length_b))

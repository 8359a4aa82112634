"""Pieces between the ranks of one host through shared memory, instead of gloo's loopback TCP.

Two ways, both tmpfs files every rank of the group maps:

- ``SharedRegion``: one copy of every wanted byte, which each rank reads its share straight into
  and hands out copy-on-write views of: no byte is copied between ranks;
- ``SharedOutboxes``: under a memory limit smaller than that copy, each reader copies a piece
  into one half of its outbox and the ranks that want it copy it out. The exchange's per-round
  status ``all_reduce`` orders the halves: a reader cannot come back to a half before every rank
  has entered the next round's ``all_reduce``, i.e. finished copying from it.

Setting up is collective and never fails a load: the ranks swap file names, map them, agree that
every rank mapped every file, and then unlink them, so nothing stays on disk whatever later
happens to the processes. If any rank cannot (ranks on other hosts or in other containers, no
tmpfs, too little room), every rank gets ``None`` and falls back together.

The files live in ``<group_shm_dir>/streamer-group-<uid>``, a directory of this user's alone
(``private_directory``): another local user who could write where the ranks look for each other's
files could hand them bytes of its own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from streamer.config import DIRECT_IO_ALIGNMENT
from streamer.engine import native
from streamer.group.plan import GroupPlan, Want
from streamer.host.safedir import Access
from streamer.plan.segments import align_down, align_up

AllGather = Callable[[torch.Tensor, str], list[torch.Tensor]]
"""The exchange's bounded ``all_gather`` of a small CPU tensor (``doing`` names it in errors)."""

_PREFIX = "streamer-group"
_MADV_POPULATE_READ = 22


class SharedMemoryWarning(RuntimeWarning):
    """The group's shared-memory directory is not this user's alone; the ranks exchange through
    the process group instead."""


def private_directory(root: str) -> str | None:
    """This user's directory for shared files under ``root`` (made 0700 if missing); None where
    there is no ``root``, or (with one ``SharedMemoryWarning``) where another user could write it."""
    if not os.path.isdir(root):
        return None
    path = os.path.join(root, f"{_PREFIX}-{os.geteuid()}")
    why = Access().prepare(path)
    if why is None:
        return path
    warnings.warn(
        f"streamer group shared memory {path!r} {why}: the ranks exchange through the process group instead",
        SharedMemoryWarning,
        stacklevel=2,
    )
    return None


def outbox_layout(plan: GroupPlan) -> tuple[dict[int, int], list[int]]:
    """Where each piece another rank wants sits in its half of its reader's outbox (by piece
    index), and the size of one half of each rank's outbox. Pieces only their reader wants are
    never posted."""
    offsets: dict[int, int] = {}
    halves = [0] * plan.world_size
    for round_ in plan.rounds():
        used = [0] * plan.world_size
        for index in round_:
            piece = plan.pieces[index]
            if any(rank != piece.reader for rank in piece.wanted_by):
                offsets[index] = used[piece.reader]
                used[piece.reader] += align_up(piece.nbytes, DIRECT_IO_ALIGNMENT)  # pages apart
        halves = [max(half, mine) for half, mine in zip(halves, used, strict=True)]
    return offsets, halves


class SharedOutboxes:
    """Every rank's outbox, mapped into this process; ``connect`` makes one, ``close`` unmaps."""

    def __init__(self, plan: GroupPlan, rank: int, maps: list[mmap.mmap]) -> None:
        self._plan = plan
        self._rank = rank
        self._offsets, self._halves = outbox_layout(plan)
        self._maps = maps
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]

    @classmethod
    def connect(
        cls, plan: GroupPlan, rank: int, directory: str, all_gather: AllGather
    ) -> SharedOutboxes | None:
        """Maps every rank's outbox on every rank, or ``None`` on every rank if any cannot."""
        _, halves = outbox_layout(plan)
        sizes = [max(DIRECT_IO_ALIGNMENT, 2 * half) for half in halves]
        token = _token()
        own = Path(directory) / _file_name(os.getpid(), token)
        created = _create(own, sizes[rank], [(0, sizes[rank])])
        doing = "setting up the shared-memory exchange"
        maps: list[mmap.mmap] = []
        try:
            names = all_gather(torch.tensor([int(created), os.getpid(), token], dtype=torch.int64), doing)
            if not all(int(n[0]) for n in names):
                return None
            maps = _open_all(directory, names, sizes)
            agreed = all_gather(torch.tensor([len(maps)], dtype=torch.int64), doing)
            if all(int(a[0]) == plan.world_size for a in agreed):
                return cls(plan, rank, maps)
            _close_all(maps)
            return None
        except BaseException:
            _close_all(maps)
            raise
        finally:
            if created:
                own.unlink()

    def post(self, index: int, round_number: int, piece: torch.Tensor) -> None:
        """This rank's piece into its outbox, if another rank wants it."""
        at = self._offsets.get(index)
        if at is not None:
            start = self._half_start(self._rank, round_number) + at
            self._bytes[self._rank][start : start + piece.numel()].copy_(piece)

    def piece(self, index: int, round_number: int) -> torch.Tensor:
        """Another rank's piece, where its reader posted it (valid until the round after next)."""
        piece = self._plan.pieces[index]
        start = self._half_start(piece.reader, round_number) + self._offsets[index]
        return self._bytes[piece.reader][start : start + piece.nbytes]

    def close(self) -> None:
        self._bytes.clear()
        _close_all(self._maps)

    def _half_start(self, rank: int, round_number: int) -> int:
        return (round_number % 2) * self._halves[rank]


@dataclass(frozen=True)
class RegionLayout:
    """Where each file's wanted bytes sit in a host's shared copy: file ``f``'s bytes from
    ``starts[f]`` (aligned down to the direct-I/O alignment, so reads land aligned) at ``bases[f]``.

    Each file's span is kept whole, so a read that runs through a short gap between two wanted
    ranges (cheaper read than skipped) still lands inside; the file is sparse, and only the pages
    reads land in are ever allocated (``SharedRegion.reserve``).
    """

    starts: dict[int, int]
    bases: dict[int, int]
    size: int

    def offset(self, file: int, position: int) -> int:
        return self.bases[file] + position - self.starts[file]


def region_layout(ranges: Sequence[Want]) -> RegionLayout:
    """The layout of ``ranges`` (disjoint, in file and offset order: a plan's wanted bytes)."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for file, begin, end in ranges:
        starts.setdefault(file, align_down(begin, DIRECT_IO_ALIGNMENT))
        ends[file] = align_up(end, DIRECT_IO_ALIGNMENT)
    bases: dict[int, int] = {}
    size = 0
    for file in starts:
        bases[file] = size
        size += ends[file] - starts[file]
    return RegionLayout(starts, bases, size)


class SharedRegion:
    """A host's one copy of the bytes a group load wants, in a tmpfs file every rank maps twice:
    shared, to read its share into, and private (copy on write) for the tensors it hands out,
    so a rank that writes into a tensor changes its own copy only.

    The file is unlinked as soon as every rank has mapped it; its memory is freed when the last
    tensor viewing it dies, on every rank.
    """

    def __init__(
        self, layout: RegionLayout, fd: int, shared: mmap.mmap, private: mmap.mmap, directory: str
    ) -> None:
        self.layout = layout
        self.directory = directory
        self._fd = fd
        self._shared: mmap.mmap | None = shared
        self._shared_bytes = torch.frombuffer(shared, dtype=torch.uint8)
        self._private = private
        self._private_bytes = torch.frombuffer(private, dtype=torch.uint8)

    @classmethod
    def connect(
        cls, layout: RegionLayout, rank: int, directory: str, all_gather: AllGather
    ) -> SharedRegion | None:
        """Rank 0 creates the file; every rank maps it, or ``None`` on every rank if one cannot.
        Each rank reserves the pages of its share as it reads (``reserve``)."""
        token = _token()
        path = Path(directory) / _file_name(os.getpid(), token)
        created = rank == 0 and _create(path, layout.size, ())
        doing = "setting up the shared-memory exchange"
        region: SharedRegion | None = None
        try:
            names = all_gather(torch.tensor([int(created), os.getpid(), token], dtype=torch.int64), doing)
            made, pid, token_0 = names[0].tolist()
            if made:
                region = _map_region(Path(directory) / _file_name(pid, token_0), layout, directory)
            agreed = all_gather(torch.tensor([region is not None], dtype=torch.int64), doing)
            if all(int(a[0]) for a in agreed):
                return region
        except BaseException:
            if region is not None:
                region.close()
            raise
        finally:
            if created:
                path.unlink()
        if region is not None:
            region.close()
        return None

    def reserve(self, file: int, begin: int, end: int) -> None:
        """Allocates the pages file bytes ``[begin, end)`` are read into and maps them in, so a
        full tmpfs is an ``OSError`` here, never a SIGBUS in a reader."""
        start = self.layout.offset(file, begin)
        os.posix_fallocate(self._fd, start, end - begin)
        native.populate(self.shared_address(file, begin), end - begin)  # fewer faults; best effort

    def shared_address(self, file: int, position: int) -> int:
        """Where this rank reads file bytes at ``position`` to."""
        return self._shared_bytes.data_ptr() + self.layout.offset(file, position)

    def shared_view(self, file: int, begin: int, end: int) -> torch.Tensor:
        """File bytes ``[begin, end)`` where this rank read them (its share's pages are mapped)."""
        start = self.layout.offset(file, begin)
        return self._shared_bytes[start : start + end - begin]

    def view(self, file: int, begin: int, end: int) -> torch.Tensor:
        """File bytes ``[begin, end)`` in this rank's private mapping, faulted in at once."""
        start = self.layout.offset(file, begin)
        _populate(self._private, start, end - begin)
        return self._private_bytes[start : start + end - begin]

    def close(self) -> None:
        """Drops the shared mapping (this rank reads no more); the private one lives on in its views."""
        shared, self._shared = self._shared, None
        if shared is not None:
            os.close(self._fd)
            del self._shared_bytes
            with contextlib.suppress(BufferError):  # a view still referenced: it goes with it
                shared.close()


def _map_region(path: Path, layout: RegionLayout, directory: str) -> SharedRegion | None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        free = os.fstatvfs(fd)
        if os.fstat(fd).st_size != layout.size or free.f_bavail * free.f_frsize < layout.size:
            os.close(fd)
            return None
        shared = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED)
        private = mmap.mmap(fd, layout.size, flags=mmap.MAP_PRIVATE)
        return SharedRegion(layout, fd, shared, private, directory)
    except (OSError, ValueError):  # ValueError: nothing to map
        os.close(fd)
        return None


def _populate(mapped: mmap.mmap, start: int, length: int) -> None:
    """Maps pages in one call rather than one fault each (MADV_POPULATE_READ, Linux 5.14)."""
    first = start - start % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        mapped.madvise(_MADV_POPULATE_READ, first, start + length - first)


def _token() -> int:
    """62 random bits: a file name no other process can guess (``secrets`` without its import of
    ``hmac``, which loads OpenSSL)."""
    return int.from_bytes(os.urandom(8), "little") >> 2


def _file_name(pid: int, token: int) -> str:
    return f"{_PREFIX}-{pid}-{token:016x}"


def _create(path: Path, size: int, reserve: Sequence[tuple[int, int]]) -> bool:
    """A new file of ``size`` bytes with the ``(offset, length)`` extents reserved, or False where
    that cannot be done here."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        for offset, length in reserve:
            os.posix_fallocate(fd, offset, length)
        os.ftruncate(fd, size)
        return True
    except OSError:
        path.unlink()
        return False
    finally:
        os.close(fd)


def _open_all(directory: str, names: list[torch.Tensor], sizes: list[int]) -> list[mmap.mmap]:
    """Every rank's outbox mapped (this rank's own among them), or none if one cannot be."""
    maps: list[mmap.mmap] = []
    for (_, pid, token), size in zip((n.tolist() for n in names), sizes, strict=True):
        try:
            fd = os.open(Path(directory) / _file_name(pid, token), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            _close_all(maps)
            return maps
        try:
            if os.fstat(fd).st_size != size:  # a stranger's file by that name
                _close_all(maps)
                return maps
            maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
        except OSError:
            _close_all(maps)
            return maps
        finally:
            os.close(fd)
    return maps


def _close_all(maps: list[mmap.mmap]) -> None:
    for mapped in maps:
        # A view handed out may still be referenced: then the mapping goes with it.
        with contextlib.suppress(BufferError):
            mapped.close()
    maps.clear()

"""CPU destination: process-owned buffers and zero-copy tensor views into them.

Each buffer is an anonymous mapping owned by a cffi object; the torch tensor
built over it keeps that object alive, and every view keeps the tensor alive.
So a buffer comes back (to its run's pool, or unmapped, its bytes returned to
the memory budget) only when the last tensor viewing it is gone: a tensor
handed to a caller never changes under it.
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from streamer.engine import native
from streamer.format.safetensors import TensorEntry


class MemoryBudget:
    """Tensor bytes of buffers that are still alive, checked against a limit.

    A buffer is charged with the tensor bytes it was made for, not its page-rounded capacity:
    rounding out to the alignment at both ends costs under 8 KiB per buffer, and must not make a
    limit of exactly N tensors too small for N tensors.

    Buffers are returned from finalizers, which may run on any thread and in the
    middle of other code on this thread; hence the re-entrant lock.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._used = 0
        self._peak = 0
        self._lock = threading.RLock()

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    def try_reserve(self, size: int, *, force: bool = False) -> bool:
        """Reserves ``size`` bytes if they fit under the limit, or unconditionally with ``force``."""
        with self._lock:
            fits = force or self.limit is None or self._used + size <= self.limit
            if fits:
                self._used += size
                self._peak = max(self._peak, self._used)
            return fits

    def release(self, size: int) -> None:
        with self._lock:
            self._used -= size


def allocate_buffer(size: int, *, hugepages: bool, budget: MemoryBudget) -> tuple[torch.Tensor, int]:
    """A uint8 tensor over fresh memory already reserved in ``budget``, and its address."""
    pointer = native.allocate(size, hugepages)

    def release(pointer: Any) -> None:
        native.free(pointer, size, hugepages)
        budget.release(size)

    return _tensor_over(native.own(pointer, size, release), size)


class BufferPool:
    """The buffers of one run, handed out again once no tensor views them.

    A buffer whose last view died is idle: no caller can see its bytes any more, so the
    next segment may be read into it. Memory that was touched before takes no page
    faults, and first touch, not copying, is what a fresh buffer costs (about 3 GB/s
    per thread against 12 GB/s for memcpy on the machines we measure). Idle buffers stay
    reserved in the budget; ``drop_idle`` unmaps them when a reservation needs the room,
    and after ``close`` every buffer is unmapped when its last view dies.
    """

    def __init__(self, budget: MemoryBudget, *, hugepages: bool) -> None:
        self._budget = budget
        self._hugepages = hugepages
        self._idle: list[tuple[Any, int, int]] = []  # (pointer, capacity, charge in the budget)
        self._closed = False
        self._lock = threading.RLock()  # released from finalizers, as MemoryBudget explains
        self.reused = 0

    def take(self, size: int) -> tuple[torch.Tensor, int, int] | None:
        """The smallest idle buffer of at least ``size`` bytes, its address and charge; None if none fits."""
        with self._lock:
            fitting = [(capacity, i) for i, (_, capacity, _) in enumerate(self._idle) if capacity >= size]
            if not fitting:
                return None
            pointer, capacity, charge = self._idle.pop(min(fitting)[1])
            self.reused += 1
        return self._wrap(pointer, capacity, charge)

    def allocate(self, capacity: int, charge: int) -> tuple[torch.Tensor, int, int]:
        """A fresh buffer of ``capacity`` bytes; its ``charge`` must already be reserved in the budget."""
        return self._wrap(native.allocate(capacity, self._hugepages), capacity, charge)

    def drop_idle(self) -> bool:
        """Unmaps the idle buffers, returning their bytes to the budget; False if there were none."""
        with self._lock:
            idle, self._idle = self._idle, []
        for pointer, capacity, charge in idle:
            self._unmap(pointer, capacity, charge)
        return bool(idle)

    def close(self) -> None:
        """Unmaps the idle buffers now and every other one when its last view dies."""
        with self._lock:
            self._closed = True
        self.drop_idle()

    def _wrap(self, pointer: Any, capacity: int, charge: int) -> tuple[torch.Tensor, int, int]:
        memory = native.own(pointer, capacity, lambda p: self._released(p, capacity, charge))
        return (*_tensor_over(memory, capacity), charge)

    def _released(self, pointer: Any, capacity: int, charge: int) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((pointer, capacity, charge))
                return
        self._unmap(pointer, capacity, charge)

    def _unmap(self, pointer: Any, capacity: int, charge: int) -> None:
        native.free(pointer, capacity, self._hugepages)
        self._budget.release(charge)


class Prefaulter:
    """Faults fresh buffers in on a thread of its own, ahead of the bytes that will land in them.

    Worth it where one thread receives every byte (the S3 event loop): first touch of fresh
    memory (~260k page faults per GiB, about 40% of a 4 GiB S3 load on our VMs) then no longer
    runs on that thread; and for the engine's O_DIRECT reads, whose readers would otherwise fault
    each block's pages in before its read (a cold 1 GiB load: 1.04x [1.00, 1.11] faster, README).
    Populating never writes, so it is safe beside the receiver; a kernel that cannot do it
    (before Linux 5.14) turns it off after the first try. Never for buffers the page fill places
    pages into: those pages must not exist yet.
    """

    # Populated 2 MiB at a time, not 64: with 64 MiB at a time the S3 receiving thread, though
    # runnable, got under 20% of a core meanwhile; 2 MiB loaded 1 GiB from the shaped endpoint
    # 1.20x [1.19, 1.31] faster, paired over 8 rounds (benchmarks/README.md). Small steps also keep
    # close() from waiting long. One task per range, not per step: submitting 512 tasks for 1 GiB
    # held the run's thread ~0.13 s (under cProfile) before its first request.
    CHUNK = 2 << 20

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-prefault")
        self._supported = True
        self._closing = False
        self.submitted = 0  # bytes handed to the thread

    def submit(self, address: int, size: int) -> None:
        if not self._supported:
            return
        self._pool.submit(self._populate, address, size)
        self.submitted += size

    def _populate(self, address: int, size: int) -> None:
        for start in range(0, size, self.CHUNK):
            if self._closing or not self._supported:
                return
            if not native.populate(address + start, min(self.CHUNK, size - start)):
                self._supported = False

    def close(self) -> None:
        """Drops what is queued and waits for the step in progress."""
        self._closing = True
        self._pool.shutdown(wait=True, cancel_futures=True)


def _tensor_over(memory: Any, size: int) -> tuple[torch.Tensor, int]:
    """A uint8 tensor over ``memory`` (keeping it alive) and its address."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about buffers it cannot prove writable
        tensor = torch.frombuffer(native.as_buffer(memory, size), dtype=torch.uint8)
    return tensor, native.address(memory)


def tensor_view(buffer: torch.Tensor, offset: int, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` whose bytes start at ``buffer[offset]``.

    Zero-copy when the offset suits the dtype's alignment (always, for files that
    safetensors writes); otherwise copied into a tensor of its own on the buffer's device.
    On the CPU its storage is just its bytes, as safetensors' tensors are, though it shares
    the buffer's memory and keeps the buffer alive: ``torch.save`` of one tensor writes that
    tensor, and nothing reached through it lies outside the bytes read for it (the page fill
    hands a tensor out while the rest of its buffer is still being filled).
    """
    dtype = entry.dtype.torch_dtype
    if (buffer.data_ptr() + offset) % entry.dtype.itemsize == 0:
        return _bytes_of(buffer, offset, entry.nbytes).view(dtype).view(entry.shape)
    aligned = torch.empty(entry.shape, dtype=dtype, device=buffer.device)
    aligned.view(-1).view(torch.uint8).copy_(buffer[offset : offset + entry.nbytes])
    return aligned


def _bytes_of(buffer: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """``buffer[offset : offset + size]``; on the CPU with a storage of those bytes alone."""
    if buffer.device.type != "cpu" or size == 0:  # frombuffer refuses an empty range
        return buffer[offset : offset + size]
    return torch.frombuffer(buffer.numpy(), dtype=torch.uint8, count=size, offset=offset)


def empty_tensor(entry: TensorEntry, device: torch.device | None = None) -> torch.Tensor:
    """A zero-size tensor needs no bytes and no buffer.

    Reshaped rather than built with that shape: ``torch.empty((0, 2**62, 4))`` overflows its
    stride computation, while safetensors (which reshapes) loads such a tensor.
    """
    return torch.empty(0, dtype=entry.dtype.torch_dtype, device=device).reshape(entry.shape)

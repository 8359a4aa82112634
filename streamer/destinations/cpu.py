"""CPU destination: process-owned buffers and zero-copy tensor views into them.

Each buffer is a fresh anonymous mapping owned by a cffi object; the torch
tensor built over it keeps that object alive, and every view keeps the tensor
alive. So a buffer is unmapped (and its bytes returned to the memory budget)
only when the last tensor viewing it is gone, and it is never reused: a
tensor handed to a caller never changes under it.
"""

from __future__ import annotations

import threading
import warnings

import torch

from streamer.engine import native
from streamer.format.safetensors import TensorEntry


class MemoryBudget:
    """Host bytes committed to buffers that are still alive, checked against a limit.

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

    @property
    def over_limit(self) -> bool:
        return self.limit is not None and self._used > self.limit

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
    memory = native.allocate(size, hugepages, lambda: budget.release(size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about buffers it cannot prove writable
        tensor = torch.frombuffer(native.as_buffer(memory, size), dtype=torch.uint8)
    return tensor, native.address(memory)


def tensor_view(buffer: torch.Tensor, offset: int, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` whose bytes start at ``buffer[offset]``.

    Zero-copy when the offset suits the dtype's alignment (always, for files that
    safetensors writes); otherwise copied into a tensor of its own on the buffer's device.
    """
    raw = buffer[offset : offset + entry.nbytes]
    dtype = entry.dtype.torch_dtype
    if (buffer.data_ptr() + offset) % entry.dtype.itemsize == 0:
        return raw.view(dtype).view(entry.shape)
    aligned = torch.empty(entry.shape, dtype=dtype, device=buffer.device)
    aligned.view(-1).view(torch.uint8).copy_(raw)
    return aligned


def empty_tensor(entry: TensorEntry, device: torch.device | None = None) -> torch.Tensor:
    """A zero-size tensor needs no bytes and no buffer."""
    return torch.empty(entry.shape, dtype=entry.dtype.torch_dtype, device=device)

"""The copy stage: moves a filled ring slot (or part of it) into its destination.

A copy runs asynchronously and is tracked by a ticket; the ring reuses a slot only once every
ticket reading from it is done. ``CudaCopyEngine`` copies host to device on a dedicated
stream; ``ThreadCopyEngine`` copies host to host on a worker thread (``load_into`` CPU
tensors).

Test seam: the staged pipeline asks ``staged_engine(device)`` for its copy engine at the start
of every load, through this module's attribute. Tests without a GPU monkeypatch it to return
a CPU stand-in for ``cpu``, which sends CPU loads through the ring exactly as GPU loads go.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from streamer.errors import DeviceError

Unpin = Callable[[], None]
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


class CopyTicket(Protocol):
    """One scheduled copy. ``done``/``wait`` raise the copy's own error if it failed."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class CopyEngine(Protocol):
    """Schedules copies and orders the consumer after them."""

    pinned: bool  # whether the ring's host memory must be page-locked for this engine

    def pin(self, memory: torch.Tensor) -> Unpin:
        """Prepares ``memory`` (a ring) for this engine's copies; returns what undoes that, to be
        called once no copy reads it and before the memory is freed."""

    def order_after_consumer(self) -> None:
        """Later copies start only after the work the consumer has queued so far (fresh or
        preallocated destinations may still be in use by it)."""

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> CopyTicket:
        """Starts copying ``src`` into ``dst`` (same shape and dtype); both stay alive until done."""

    def consumer_wait(self, ticket: CopyTicket) -> None:
        """Makes what the consumer does next see the copy's bytes, without blocking the host
        longer than needed."""

    def close(self) -> None:
        """Releases threads or streams; every ticket must be done."""


class _CudaTicket:
    def __init__(self, event: torch.cuda.Event, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.event = event
        self._keep: tuple[torch.Tensor, ...] = (src, dst)  # alive until the device has read/written them

    def done(self) -> bool:
        finished = bool(self.event.query())  # type: ignore[no-untyped-call]
        if finished:
            self._keep = ()
        return finished

    def wait(self) -> None:
        self.event.synchronize()
        self._keep = ()


class CudaCopyEngine:
    """Host-to-device copies with ``non_blocking=True`` on one dedicated stream, one event each."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def pin(self, memory: torch.Tensor) -> Unpin:
        """Registers memory the ring allocated itself, rather than taking torch's pinned
        allocator's: that one may round a request up to a power of two (pinning up to twice the
        memory limit) or hand out a block that is not page-aligned, as O_DIRECT reads need."""
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        address, size = memory.data_ptr(), memory.numel() * memory.element_size()
        error = int(cudart.cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE))
        if error:
            raise DeviceError(
                f"could not page-lock the {size}-byte host ring for {self._device} (cudaError {error})"
            )

        def unpin() -> None:
            cudart.cudaHostUnregister(address)  # fails only once CUDA is torn down at exit

        return unpin

    def order_after_consumer(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> _CudaTicket:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event.record(self._stream)
        return _CudaTicket(event, src, dst)

    def consumer_wait(self, ticket: CopyTicket) -> None:
        assert isinstance(ticket, _CudaTicket)
        torch.cuda.current_stream(self._device).wait_event(ticket.event)

    def close(self) -> None:
        self._stream.synchronize()


class _FutureTicket:
    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def done(self) -> bool:
        if not self.future.done():
            return False
        self.future.result()  # raises the copy's error
        return True

    def wait(self) -> None:
        self.future.result()


class ThreadCopyEngine:
    """Host-to-host copies on worker threads, so that the consumer and the readers never memcpy."""

    pinned = False

    def __init__(self, workers: int = 1) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="streamer-copy")

    def pin(self, memory: torch.Tensor) -> Unpin:
        """Host copies read any memory."""
        return _nothing

    def order_after_consumer(self) -> None:
        """CPU work the consumer queued has already happened."""

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> _FutureTicket:
        return _FutureTicket(self._pool.submit(self._copy, src, dst))

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(src)

    def consumer_wait(self, ticket: CopyTicket) -> None:
        ticket.wait()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _nothing() -> None:
    pass


def staged_engine(device: torch.device) -> CopyEngine | None:
    """The copy engine for loads into ``device`` through the host ring; ``None`` for ``cpu``,
    which the reader threads fill directly. See the module docstring for the test seam."""
    if device.type == "cuda":
        return CudaCopyEngine(device)
    return None

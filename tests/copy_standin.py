"""A CPU stand-in for the GPU copy engine, instrumented to catch a ring that recycles slots early.

Tests install it through the pipeline's seam, ``streamer.destinations.copy_engine.staged_engine``
(see that module), so that a ``device="cpu"`` load runs the whole staged path: ring,
backpressure, slot reuse, ordering and error handling, with CPU tensors as the "device".
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from typing import Any

import pytest
import torch

from streamer.destinations import copy_engine
from streamer.destinations.copy_engine import CopyTicket, ThreadCopyEngine, Unpin
from streamer.engine import native


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.blake2b(tensor.numpy().tobytes(), digest_size=16).hexdigest()


class StandInCopyEngine(ThreadCopyEngine):
    """Copies on several threads after random delays, so copies finish late and out of order.

    Each source range is checksummed when the copy is scheduled and again just before it runs:
    a slot refilled under an outstanding copy shows up as a mismatch. ``busy`` holds the source
    ranges of copies not finished yet; ``fail_at`` makes that copy (0-based) raise. ``pinned``
    makes it ask for a pinned ring, as the CUDA engine does, and log each pin and unpin to ``pins``.
    """

    def __init__(
        self,
        *,
        workers: int = 3,
        max_delay: float = 0.003,
        fail_at: int | None = None,
        pinned: bool = False,
        pins: list[tuple[str, int, int]] | None = None,
    ) -> None:
        super().__init__(workers)
        self.pinned = pinned
        self.pins = pins if pins is not None else []
        self.max_delay = max_delay
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.busy: dict[tuple[int, int], str] = {}  # (address, length) -> digest when scheduled
        self.violations: list[str] = []
        self.scheduled = 0
        self.finished = 0
        self.failing: set[tuple[int, int]] = set()
        self.closed = False
        self._random = random.Random(1234)

    def pin(self, memory: torch.Tensor) -> Unpin:
        address, size = memory.data_ptr(), memory.numel()
        self.pins.append(("pin", address, size))
        return lambda: self.pins.append(("unpin", address, size))

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> CopyTicket:
        key = (src.data_ptr(), src.numel())
        with self.lock:
            if key in self.busy:
                self.violations.append(f"source range {key} scheduled twice")
            self.busy[key] = _digest(src)
            if self.scheduled == self.fail_at:
                self.failing.add(key)
            self.scheduled += 1
        return super().copy(src, dst)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        time.sleep(self._random.uniform(0, self.max_delay))
        key = (src.data_ptr(), src.numel())
        with self.lock:
            expected = self.busy.get(key)
            fail = key in self.failing
        if expected != _digest(src):
            with self.lock:
                self.violations.append(f"source range {key} changed between scheduling and copying")
        if not fail:
            dst.copy_(src)
        with self.lock:
            self.busy.pop(key, None)
            self.failing.discard(key)
            self.finished += 1
        if fail:
            raise RuntimeError("injected copy failure")

    def overlaps_busy(self, address: int, length: int) -> bool:
        with self.lock:
            return any(a < address + length and address < a + n for a, n in self.busy)

    def close(self) -> None:
        super().close()
        self.closed = True


class StandIn:
    """Installs stand-ins for every staged load of a test and watches every engine submission."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engines: list[StandInCopyEngine] = []
        self.options: dict[str, Any] = {}
        self.reads_into_busy: list[str] = []
        monkeypatch.setattr(copy_engine, "staged_engine", self._make)
        submit = native.Engine.submit
        standin = self

        def checked_submit(engine: native.Engine, blocks: Any) -> None:
            for block in blocks:
                for copier in standin.engines:
                    if copier.overlaps_busy(block.dst, block.read_length):
                        standin.reads_into_busy.append(f"read at file offset {block.read_offset}")
            submit(engine, blocks)

        monkeypatch.setattr(native.Engine, "submit", checked_submit)

    def _make(self, device: torch.device) -> StandInCopyEngine:
        engine = StandInCopyEngine(**self.options)
        self.engines.append(engine)
        return engine

    def assert_clean(self) -> None:
        """No slot was refilled or rescheduled under an outstanding copy; every engine closed."""
        assert self.reads_into_busy == []
        for engine in self.engines:
            assert engine.violations == []
            assert engine.closed

"""Holding CPython's cyclic garbage collector off while an object-store load starts.

Why: a process that has just imported torch owes a full collection (~170,000 objects, ~0.1 s on
our VMs), and the next few thousand objects any code creates set it off. An object store's bytes
are all received by one event loop thread that needs the GIL (``Delivery.ONE_RECEIVER``): a full
collection that lands while a run's first GETs are being signed and sent holds every one of them
back by as long. Held off until the run's first block has landed, it runs while the GETs are in
flight, their bytes waiting in socket buffers (1 GiB from the shaped S3 endpoint: see
``benchmarks/README.md``).

The collector is the process's: holds are counted across threads. The first hold turns automatic
collection off if it was on; the last release turns it back on (even if the application turned it
off meanwhile: it was on when the first hold began). ``gc.collect()`` works throughout.
"""

from __future__ import annotations

import gc
import threading


class _Collector:
    """The process's count of holds and whether the last release turns collection back on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holds = 0
        self.restore = False


_COLLECTOR = _Collector()


class CollectorHold:
    """One hold on automatic garbage collection; ``release()`` (idempotent, from any thread) ends it.

    Its owner must release it: holders bound it in time (``ObjectStoreClient.hold_collector``).
    """

    def __init__(self) -> None:
        self._held = True
        with _COLLECTOR.lock:
            if _COLLECTOR.holds == 0:
                _COLLECTOR.restore = gc.isenabled()
                gc.disable()
            _COLLECTOR.holds += 1

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        with _COLLECTOR.lock:
            if not self._held:
                return
            self._held = False
            _COLLECTOR.holds -= 1
            if _COLLECTOR.holds == 0 and _COLLECTOR.restore:
                gc.enable()

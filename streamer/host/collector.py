"""Holding CPython's cyclic garbage collector off while an object-store load starts.

Why: a process that has just imported torch owes a full collection (~170,000 objects, ~0.1 s on
our VMs), and the next few thousand objects any code creates set it off. An object store's bytes
are all received by one event loop thread that needs the GIL (``Delivery.ONE_RECEIVER``): a full
collection that lands while a run's GETs are being signed, sent or received holds every one of
them back by as long, and a connection whose socket buffer fills meanwhile stops its sender. Held
off until the run ends, it runs once the load has returned (1 GiB from the shaped S3 endpoint: see
``benchmarks/README.md``). A load makes little cyclic garbage to hold back meanwhile (~500
objects per GiB).

The collector is the process's: holds are counted across threads. The first hold turns automatic
collection off if it was on; the last release turns it back on (even if the application turned it
off meanwhile: it was on when the first hold began). ``gc.collect()`` works throughout. A child
forked during a hold starts with none (the threads that would end it are not there): its collector
is as the first hold found it.
"""

from __future__ import annotations

import gc
import os
import threading


class _Collector:
    """The process's count of holds, whether the last release turns collection back on, and which
    process the holds belong to (a forked child's are none of its own)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holds = 0
        self.restore = False
        self.pid = os.getpid()

    def forked(self) -> None:
        """In a child: its parent's holds end here, as the parent's last release would end them."""
        self.lock = threading.Lock()  # the parent's may have been held by a thread the child lacks
        if self.holds and self.restore:
            gc.enable()
        self.holds = 0
        self.pid = os.getpid()


_COLLECTOR = _Collector()
os.register_at_fork(after_in_child=_COLLECTOR.forked)


class CollectorHold:
    """One hold on automatic garbage collection; ``release()`` (idempotent, from any thread) ends it.

    Its owner must release it: holders bound it in time (``ObjectStoreClient.hold_collector``).
    """

    def __init__(self) -> None:
        self._held = True
        self._pid = os.getpid()
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
            if self._pid != _COLLECTOR.pid:
                return  # a hold of the parent this process was forked from
            _COLLECTOR.holds -= 1
            if _COLLECTOR.holds == 0 and _COLLECTOR.restore:
                gc.enable()

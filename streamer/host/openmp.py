"""torch's OpenMP team, lent to in-process CPU work: the inline reads of small runs.

After each parallel operator, torch's OpenMP threads spin awake for milliseconds before they sleep
(libgomp spins ~300,000 times). Threads a load starts then take turns with them on the cores: on
2 cores a 16-40 MiB read ran ~1.3x slower than the same read handed to the team, which runs it on
those spinning threads at once (``benchmarks/small_files.py``). The team is reached through the
runtime's ``GOMP_parallel``: libgomp's, also the GOMP entry of LLVM's and Intel's runtimes.

The runtime is only ever found, never loaded: the one torch's own library maps (by its file in
``/proc/self/maps``). A child forked from a process that imported streamer gets none and reads on
threads of its own: GNU OpenMP's thread pool does not survive a fork (a team call in the child
waits for threads that no longer exist, as torch's own parallel operators do there).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from pathlib import Path

import torch

_RUNTIME_FILE = r"/lib(?:gomp|iomp5|omp)(?:-[0-9a-f]+)?\.so(?:\.\d+)*$"
MAPS = "/proc/self/maps"


def team_threads() -> int:
    """Threads a team runs CPU work on: torch's intra-op parallelism (``torch.set_num_threads``)."""
    return max(1, torch.get_num_threads())


def running_team(threads: int) -> int | None:
    """``team_entry()`` where torch's team of ``threads`` has evidently been started: on the main
    thread (each thread that calls into OpenMP gets a team of its own), once the process has the
    team's ``threads - 1`` workers more than when streamer was imported (torch starts them at its
    first parallel operator). Before that a team call would start threads that stay for the life
    of the process, and a load would look as if it left them behind: there the caller reads on
    threads of its own, joined before it returns. (Where torch had run a parallel operator before
    streamer was imported, its team is not told apart: loads read on threads of their own.)"""
    main = threading.current_thread() is threading.main_thread()
    if not main or process_threads() < _THREADS_AT_IMPORT + threads - 1:
        return None
    return team_entry()


def process_threads() -> int:
    """The process's threads, native ones included (``/proc/self/stat``'s num_threads; ~10 us); 0
    where there is no ``/proc`` (then no team is ever taken for running)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[17])  # field 20 of proc(5), counted after "pid (comm)"


class _Runtime:
    """The runtime's ``GOMP_parallel``, looked up once per process; none after a fork."""

    def __init__(self) -> None:
        self._entry: int | None = None
        self._looked = False
        self._forked = False

    def entry(self) -> int | None:
        """The address of ``GOMP_parallel`` in the OpenMP runtime torch runs its operators on; None
        where torch's parallel backend is not OpenMP, its runtime cannot be told apart or lacks
        the entry, or this process is a forked child."""
        if self._forked:
            return None
        if not self._looked:
            self._entry = _find_entry()
            self._looked = True
        return self._entry

    def forget(self) -> None:
        self._forked = True


def _find_entry() -> int | None:
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    path = runtime_path(Path(MAPS).read_text(), Path(torch.__file__).resolve().parent)
    if path is None:
        return None
    try:  # RTLD_NOLOAD: only a runtime already in the process (torch's), never a second one
        runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        entry = runtime.GOMP_parallel
    except (OSError, AttributeError):
        return None
    address: int | None = ctypes.cast(entry, ctypes.c_void_p).value
    return address


_RUNTIME = _Runtime()
_THREADS_AT_IMPORT = process_threads()
os.register_at_fork(after_in_child=_RUNTIME.forget)
team_entry = _RUNTIME.entry


def runtime_path(maps: str, torch_dir: Path) -> str | None:
    """The OpenMP runtime among the files mapped in ``maps`` (``/proc/<pid>/maps`` text): the one
    under ``torch_dir`` (torch's wheel bundles its own), else the only one; None if none, or
    several with none of them torch's."""
    found = {line.split(maxsplit=5)[5] for line in maps.splitlines() if re.search(_RUNTIME_FILE, line)}
    torch_own = [path for path in found if Path(path).is_relative_to(torch_dir)]
    if len(torch_own) == 1:
        return torch_own[0]
    return next(iter(found)) if len(found) == 1 else None

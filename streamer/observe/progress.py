"""A bytes progress bar for long loads: tqdm's when it is installed, else a line on stderr now and then.

A 100+ GB load takes minutes; a user (or vLLM's first rank) wants to see bytes and GB/s move.
tqdm is not a dependency: without it the bar is a plain line at most once per second.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

_PLAIN_INTERVAL_S = 1.0


class ByteProgress:
    """Counts loaded bytes against ``total``; a no-op when not ``enabled``. Use as a context manager."""

    def __init__(self, total: int, *, desc: str = "Loading weights", enabled: bool = True) -> None:
        self._total = total
        self._desc = desc
        self._enabled = enabled
        self._done = 0
        self._started = time.perf_counter()
        self._printed = self._started
        self._bar: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, dynamic_ncols=True)

    def update(self, nbytes: int) -> None:
        if not self._enabled:
            return
        self._done += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
            return
        now = time.perf_counter()
        if now - self._printed >= _PLAIN_INTERVAL_S or self._done >= self._total:
            self._printed = now
            self._print_line(now)

    def _print_line(self, now: float) -> None:
        rate = self._done / max(now - self._started, 1e-9) / 1e9
        print(
            f"{self._desc}: {self._done / 1e9:.2f}/{self._total / 1e9:.2f} GB, {rate:.2f} GB/s",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

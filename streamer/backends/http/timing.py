"""Time bounds of one try: a deadline, and curl's low-speed rule."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LowSpeed:
    """curl's low-speed rule for one try: it is too slow once some ``window`` seconds of it moved
    fewer than ``rate * window`` bytes. The try adds what it receives to ``moved``; a server that
    trickles a byte at a time never lets a read time out, and this still cuts it."""

    def __init__(self, rate: int, window: float) -> None:
        self.rate = rate
        self.window = window
        self.moved = 0
        self._marks: collections.deque[tuple[float, int]] = collections.deque()

    def too_slow(self, now: float) -> bool:
        """Called every ``step`` seconds or so while the try runs."""
        marks = self._marks
        marks.append((now, self.moved))
        while len(marks) > 1 and marks[1][0] <= now - self.window:
            marks.popleft()
        since, moved = marks[0]
        return now - since >= self.window and self.moved - moved < self.rate * self.window

    @property
    def step(self) -> float:
        return self.window / 10


class TooSlow(TimeoutError):
    """A try cut by the low-speed rule (``LowSpeed``)."""


async def bounded(
    coroutine: Coroutine[Any, Any, T],
    seconds: float,
    *,
    discard: Callable[[T], None] | None = None,
    speed: LowSpeed | None = None,
) -> T:
    """``coroutine``'s result, or ``TimeoutError`` after ``seconds``, or ``TooSlow`` once ``speed``
    says so (it is then cancelled).

    Unlike ``asyncio.wait_for`` on Python < 3.12, an exception the coroutine raises as the caller
    is cancelled is still retrieved: no "Task exception was never retrieved" at shutdown. A result
    that arrives as the caller is cancelled goes to ``discard`` (a connection that would else stay
    open, unowned, for as long as the process lives).
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coroutine)
    interrupted = slow = False
    until = loop.time() + seconds
    try:
        if speed is not None:
            speed.too_slow(loop.time())
        while not task.done() and loop.time() < until and not slow:
            left = until - loop.time()
            await asyncio.wait({task}, timeout=left if speed is None else min(left, speed.step))
            slow = speed is not None and not task.done() and speed.too_slow(loop.time())
    except asyncio.CancelledError:
        interrupted = True
    while not task.done():  # cancelled again while it winds down: it still ends before we do
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=0.05)
        except asyncio.CancelledError:
            interrupted = True
    if not task.cancelled():
        task.exception()
    if interrupted:
        if discard is not None and not task.cancelled() and task.exception() is None:
            discard(task.result())
        raise asyncio.CancelledError
    if task.cancelled():
        if slow:
            assert speed is not None
            raise TooSlow(f"under {speed.rate} bytes/s for {speed.window:g} s")
        raise TimeoutError(f"no answer within {seconds:.3g} s")
    return task.result()

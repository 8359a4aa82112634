"""Read-ahead for a walk over a checkpoint's keys, one ``get_tensor`` per key.

safetensors' idiom, ``for k in f.keys(): f.get_tensor(k)``, makes each tensor a run of its own:
readers start, read one tensor and stop, and sit idle while the caller works. Once two calls ask
for neighbouring keys, the keys that follow are read together in one run, a window that doubles
with each window used up (to half of ``MAX_AHEAD_BYTES``, or of the streaming budget where
smaller). While the caller takes the tensors of one window, a thread reads the next one, so the
reads overlap the caller's work. A call off the walk drops what was read ahead and reads its
tensor alone.

An error is raised by the call that asks for the tensor it belongs to: a window that fails is
read again as the asked tensor alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from streamer.errors import StreamerError

MIN_WINDOW_BYTES = 16 << 20
MAX_AHEAD_BYTES = 512 << 20


class _Window:
    """Keys read by a thread of their own while the caller takes the window before them."""

    def __init__(self, names: list[str], read_many: Callable[[list[str]], list[torch.Tensor]]) -> None:
        self.names = names
        self._tensors: list[torch.Tensor] | None = None
        self._failure: BaseException | None = None
        self._thread = threading.Thread(
            target=self._read, args=(read_many,), name="streamer-readahead", daemon=True
        )
        self._thread.start()

    def _read(self, read_many: Callable[[list[str]], list[torch.Tensor]]) -> None:
        try:
            self._tensors = read_many(self.names)
        except BaseException as failure:  # handed to the caller that asks for these keys
            self._failure = failure

    def join(self) -> None:
        self._thread.join()

    def wait(self) -> list[torch.Tensor] | None:
        """The window's tensors; None if its read failed with a ``StreamerError``, which the
        caller's own read then reports. Anything else the read raised is raised here."""
        self.join()
        if self._failure is not None and not isinstance(self._failure, StreamerError):
            raise self._failure
        return self._tensors


class KeyWalk:
    """Serves ``get(name)`` for a handle whose keys are walked in ``order``.

    ``read_one`` reads one tensor by name; ``read_many`` reads several in one run (in the order
    given); ``nbytes`` says how many bytes a tensor has. Tensors read ahead are held until asked
    for, dropped by a call off the walk, or by ``clear``: at most ``max_ahead_bytes`` of them (a
    window in hand and the next, each at most half of it, or one tensor where that is larger).
    """

    def __init__(
        self,
        order: Sequence[str],
        read_one: Callable[[str], torch.Tensor],
        read_many: Callable[[list[str]], list[torch.Tensor]],
        nbytes: Callable[[str], int],
        *,
        max_ahead_bytes: int = MAX_AHEAD_BYTES,
    ) -> None:
        self._order = list(order)
        self._position = {name: i for i, name in enumerate(self._order)}
        self._read_one = read_one
        self._read_many = read_many
        self._nbytes = nbytes
        self._max_window = max(1, max_ahead_bytes // 2)
        self._window = 0  # bytes of the next window; 0 until the walk is seen
        self._last: int | None = None  # position of the last key asked for
        self._ahead: dict[str, torch.Tensor] = {}
        self._next: _Window | None = None  # the window after the one in hand, being read
        self._lock = threading.Lock()
        self.windows = 0  # reads of more than the one tensor asked for

    def get(self, name: str) -> torch.Tensor:
        with self._lock:
            position = self._position[name]
            walking = self._last is not None and position == self._last + 1
            self._last = position
            ahead = self._ahead.pop(name, None)
            if ahead is not None:
                return ahead
            if walking and self._next is not None and self._next.names[0] == name:
                read = self._next.wait()  # if interrupted, the window stays for clear() to join
                names, self._next = self._next.names, None
                return self._take(names, read)
            self._drop()
            if not walking:
                self._window = 0
                return self._read_one(name)
            self._grow()
            names = self._window_from(position)
            if len(names) == 1:
                return self._read_one(name)
            try:
                tensors: list[torch.Tensor] | None = self._read_many(names)
            except StreamerError:
                tensors = None
            return self._take(names, tensors)

    def clear(self) -> None:
        """Drops what was read ahead, once a window being read is done (the handle is closing)."""
        with self._lock:
            self._drop()
            self._last = None
            self._window = 0

    def _take(self, names: list[str], tensors: list[torch.Tensor] | None) -> torch.Tensor:
        """Hands out the first of a window read, keeps the rest and starts reading the next window;
        a window that failed is the asked tensor read alone."""
        if tensors is None:
            self._window = 0
            return self._read_one(names[0])  # its own error, or the tensor if the fault was elsewhere
        self.windows += 1
        self._ahead = dict(zip(names[1:], tensors[1:], strict=True))
        after = self._position[names[-1]] + 1
        if after < len(self._order):
            self._grow()
            following = self._window_from(after)
            # A tensor larger than a window is left to its own call, read alone under the limit.
            if len(following) > 1 or self._nbytes(following[0]) <= self._window:
                self._next = _Window(following, self._read_many)
        return tensors[0]

    def _drop(self) -> None:
        self._ahead.clear()
        if self._next is not None:
            window, self._next = self._next, None
            window.join()  # nobody asked for its keys: what it read, or why it failed, is moot

    def _grow(self) -> None:
        self._window = min(self._max_window, max(MIN_WINDOW_BYTES, 2 * self._window))

    def _window_from(self, position: int) -> list[str]:
        """The key at ``position`` and those after it while the window's bytes allow."""
        names = [self._order[position]]
        used = self._nbytes(names[0])
        for name in self._order[position + 1 :]:
            used += self._nbytes(name)
            if used > self._window:
                break
            names.append(name)
        return names

"""Read-ahead for a walk over a checkpoint's keys, one ``get_tensor`` per key.

safetensors' idiom, ``for k in f.keys(): f.get_tensor(k)``, makes each tensor a run of its own:
readers start, read one tensor and stop, and sit idle while the caller works. Once two calls ask
for neighbouring keys, the keys that follow are read together in one run, a window that doubles
with each window used up (to ``MAX_WINDOW_BYTES``, or the streaming budget where smaller), and handed
out from there. A call off the walk drops what was read ahead and reads its tensor alone.

A window is read before the tensor asked for is returned, so an error is raised by the call that
asks for the tensor it belongs to: a window that fails is read again as the asked tensor alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from streamer.errors import StreamerError

MIN_WINDOW_BYTES = 16 << 20
MAX_WINDOW_BYTES = 256 << 20


class KeyWalk:
    """Serves ``get(name)`` for a handle whose keys are walked in ``order``.

    ``read_one`` reads one tensor by name; ``read_many`` reads several in one run (in the order
    given); ``nbytes`` says how many bytes a tensor has. Tensors read ahead are held until asked
    for, dropped by a call off the walk, or by ``clear``: at most one window of them.
    """

    def __init__(
        self,
        order: Sequence[str],
        read_one: Callable[[str], torch.Tensor],
        read_many: Callable[[list[str]], list[torch.Tensor]],
        nbytes: Callable[[str], int],
        *,
        max_window_bytes: int = MAX_WINDOW_BYTES,
    ) -> None:
        self._order = list(order)
        self._position = {name: i for i, name in enumerate(self._order)}
        self._read_one = read_one
        self._read_many = read_many
        self._nbytes = nbytes
        self._max_window = max(1, max_window_bytes)
        self._window = 0  # bytes of the next window; 0 until the walk is seen
        self._last: int | None = None  # position of the last key asked for
        self._ahead: dict[str, torch.Tensor] = {}
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
            self._ahead.clear()
            if not walking:
                self._window = 0
                return self._read_one(name)
            self._window = min(self._max_window, max(MIN_WINDOW_BYTES, 2 * self._window))
            names = self._window_from(position)
            if len(names) == 1:
                return self._read_one(name)
            try:
                tensors = self._read_many(names)
            except StreamerError:
                self._window = 0
                return self._read_one(name)  # its own error, or the tensor if the fault was elsewhere
            self.windows += 1
            self._ahead = dict(zip(names[1:], tensors[1:], strict=True))
            return tensors[0]

    def clear(self) -> None:
        """Drops what was read ahead (the handle is closing)."""
        with self._lock:
            self._ahead.clear()
            self._last = None
            self._window = 0

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

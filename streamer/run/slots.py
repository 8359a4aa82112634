"""Ring slot bookkeeping: which piece holds which slot, which copies out of it still run.

A slot is taken when a piece's read is queued and comes back only once the read is done and
every copy out of the slot finished: refilling it earlier would overwrite bytes a copy has not
read yet. Reads and copies are started by the staged sink; this table only says when.
"""

from __future__ import annotations

import contextlib
from collections import deque

from streamer.destinations.copy_engine import CopyTicket


class CopyFailed(Exception):
    """A copy out of ``piece``'s slot failed; ``__cause__`` is the copy's own error."""

    def __init__(self, piece: int) -> None:
        super().__init__(f"a copy out of the slot of piece {piece} failed")
        self.piece = piece


class SlotTable:
    """``slots`` ring slots, lent to pieces (numbered by the caller) in the order they are taken."""

    def __init__(self, slots: int) -> None:
        self._free = deque(range(slots))
        self._slot_of: dict[int, int] = {}
        self._copying: dict[int, list[CopyTicket]] = {}  # read pieces -> copies still running, oldest first

    def take(self, piece: int) -> int | None:
        """A free slot for ``piece`` to be read into, or None when every slot is lent."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._slot_of[piece] = slot
        return slot

    def slot(self, piece: int) -> int:
        return self._slot_of[piece]

    def filled(self, piece: int) -> None:
        """``piece`` is read; its copies (``copying``) follow, possibly none."""
        self._copying[piece] = []

    def copying(self, piece: int, ticket: CopyTicket) -> None:
        """``ticket`` copies out of ``piece``'s slot: the slot waits for it."""
        self._copying[piece].append(ticket)

    @property
    def busy(self) -> bool:
        """Some read piece still holds its slot (its copies may have finished since ``recycle``)."""
        return bool(self._copying)

    def wait_oldest(self) -> None:
        """Blocks until the copies of the piece read first are done."""
        piece = next(iter(self._copying))
        try:
            for ticket in self._copying[piece]:
                ticket.wait()
        except Exception as exc:
            raise CopyFailed(piece) from exc

    def recycle(self) -> list[int]:
        """The pieces whose copies all finished, oldest first; their slots are free again."""
        finished = [piece for piece, tickets in self._copying.items() if self._done(piece, tickets)]
        for piece in finished:
            del self._copying[piece]
            self._free.append(self._slot_of.pop(piece))
        return finished

    def drain(self) -> None:
        """Waits for every copy still running (the run failed or was abandoned: their errors are moot)."""
        copying, self._copying = self._copying, {}
        for tickets in copying.values():
            for ticket in tickets:
                with contextlib.suppress(Exception):
                    ticket.wait()

    @staticmethod
    def _done(piece: int, tickets: list[CopyTicket]) -> bool:
        try:
            return all(ticket.done() for ticket in tickets)
        except Exception as exc:
            raise CopyFailed(piece) from exc

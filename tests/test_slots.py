"""The ring's slot table: a slot is lent to one piece from its read until its last copy is done.

Unit tests with tickets the test finishes by hand; tests/test_staged.py runs the table inside
real staged loads, where the stand-in copy engine catches a slot refilled under a copy.
"""

from __future__ import annotations

import pytest

from streamer.run.slots import CopyFailed, SlotTable


class Ticket:
    """A copy that finishes (or fails) when the test says so; ``wait`` finishes it."""

    def __init__(self, error: Exception | None = None) -> None:
        self.finished = False
        self.error = error
        self.waited = 0

    def done(self) -> bool:
        if self.finished and self.error is not None:
            raise self.error
        return self.finished

    def wait(self) -> None:
        self.waited += 1
        self.finished = True
        if self.error is not None:
            raise self.error


def test_slots_are_lent_in_order_until_none_is_free() -> None:
    table = SlotTable(3)
    assert [table.take(piece) for piece in range(3)] == [0, 1, 2]
    assert table.take(3) is None
    assert [table.slot(piece) for piece in range(3)] == [0, 1, 2]
    assert not table.busy  # reads in flight are the sink's to count; no copy holds a slot yet


def test_a_slot_comes_back_only_after_every_copy_out_of_it() -> None:
    table = SlotTable(1)
    assert table.take(0) == 0
    assert table.recycle() == []  # still being read
    table.filled(0)
    first, second = Ticket(), Ticket()
    table.copying(0, first)
    table.copying(0, second)
    assert table.busy
    first.finished = True
    assert table.recycle() == []
    assert table.take(1) is None
    second.finished = True
    assert table.recycle() == [0]
    assert not table.busy
    assert table.take(1) == 0
    assert table.slot(1) == 0


def test_a_piece_with_nothing_to_copy_frees_its_slot_once_read() -> None:
    table = SlotTable(1)
    table.take(0)
    table.filled(0)  # padding between tensors: read, copied nowhere
    assert table.busy
    assert table.recycle() == [0]
    assert table.take(1) == 0


def test_finished_pieces_come_back_oldest_first_whatever_order_their_copies_end() -> None:
    table = SlotTable(3)
    tickets = {}
    for piece in (0, 1, 2):
        table.take(piece)
    for piece in (2, 0, 1):  # reads complete out of order
        table.filled(piece)
        tickets[piece] = Ticket()
        table.copying(piece, tickets[piece])
    tickets[1].finished = True
    assert table.recycle() == [1]
    assert table.take(3) == 1
    tickets[0].finished = tickets[2].finished = True
    assert table.recycle() == [2, 0]
    assert [table.take(4), table.take(5)] == [2, 0]


def test_wait_oldest_waits_for_the_piece_read_first() -> None:
    table = SlotTable(2)
    table.take(0)
    table.take(1)
    table.filled(1)
    late, early = Ticket(), Ticket()
    table.copying(1, late)
    table.filled(0)
    table.copying(0, early)
    table.wait_oldest()
    assert (late.waited, early.waited) == (1, 0)
    assert table.recycle() == [1]


@pytest.mark.parametrize("check", ["recycle", "wait_oldest"])
def test_a_failed_copy_names_its_piece_and_keeps_its_error(check: str) -> None:
    table = SlotTable(2)
    table.take(0)
    table.take(1)
    table.filled(1)  # read first: the oldest
    error = RuntimeError("copy failed")
    broken = Ticket(error)
    broken.finished = True
    table.copying(1, broken)
    table.filled(0)
    table.copying(0, Ticket())
    with pytest.raises(CopyFailed) as info:
        getattr(table, check)()
    assert info.value.piece == 1
    assert info.value.__cause__ is error


def test_drain_waits_for_every_running_copy_and_ignores_their_errors() -> None:
    table = SlotTable(2)
    tickets = [Ticket(), Ticket(RuntimeError("lost")), Ticket()]
    for piece in (0, 1):
        table.take(piece)
        table.filled(piece)
    table.copying(0, tickets[0])
    table.copying(0, tickets[1])
    table.copying(1, tickets[2])
    table.drain()
    assert [t.waited for t in tickets] == [1, 1, 1]
    assert not table.busy
    table.drain()  # nothing left: a second close waits for nothing
    assert [t.waited for t in tickets] == [1, 1, 1]

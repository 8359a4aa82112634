"""The engine's work items as plain tuples: what the planner produces and the binding passes to C.

Kept apart from the cffi binding so that planning stays pure (no native library, no cffi).
"""

from __future__ import annotations

from typing import NamedTuple


class Unit(NamedTuple):
    """Bytes ``[begin, end)`` of engine file ``file`` that complete together (a tensor, a ring piece)."""

    file: int
    begin: int
    end: int


class Block(NamedTuple):
    """One read: see ``se_block`` in native/include/streamer_engine.h."""

    file: int
    first_unit: int
    last_unit: int
    acc_begin: int
    acc_end: int
    read_offset: int
    read_length: int
    dst: int  # address, or an offset into a buffer until the run adds the buffer's address

"""The engine's work items as plain tuples: what the planner produces and the binding passes to C.

Kept apart from the cffi binding so that planning stays pure (no native library, no cffi).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, overload

import numpy as np


class Unit(NamedTuple):
    """Bytes ``[begin, end)`` of engine file ``file`` that complete together (a tensor, a ring piece).

    ``need``: how many of them blocks credit before it completes; 0, all of them. A sliced tensor
    read as scattered ranges is one unit whose ``need`` is their total.
    """

    file: int
    begin: int
    end: int
    need: int = 0


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
    flags: int = 0  # SE_BLOCK_* (BLOCK_FILL: placed through the run's page fill)


# ``se_block``'s layout (the binding checks it against the header's when it loads the engine).
BLOCK_DTYPE = np.dtype(
    {
        "names": list(Block._fields),
        "formats": ["<i4", "<u4", "<u4", "<u8", "<u8", "<u8", "<u8", "<u8", "<u4"],
        "offsets": [0, 4, 8, 16, 24, 32, 40, 48, 12],
        "itemsize": 56,
    }
)


class BlockArray(Sequence[Block]):
    """Many blocks in one array laid out as ``se_block[]``: the engine takes them in one call.

    A sliced tensor can need tens of thousands of small reads; as tuples each would cost
    microseconds of Python to build, rebase and convert, more than reading its bytes.
    Indexing and iterating still give ``Block`` tuples, for storages that fetch blocks themselves.
    """

    def __init__(self, table: np.ndarray) -> None:
        if table.dtype != BLOCK_DTYPE or table.ndim != 1:
            raise ValueError(f"a block table is a 1-d array of BLOCK_DTYPE, not {table.dtype} {table.shape}")
        self.table = np.ascontiguousarray(table)

    @classmethod
    def build(
        cls,
        *,
        file: int,
        unit: int,
        acc_begin: np.ndarray,
        acc_end: np.ndarray,
        read_offset: np.ndarray,
        read_length: np.ndarray,
        dst: np.ndarray,
    ) -> BlockArray:
        """Blocks of one file that all credit ``unit``; the other columns are int64 arrays."""
        table = np.zeros(len(acc_begin), dtype=BLOCK_DTYPE)
        table["file"] = file
        table["first_unit"] = unit
        table["last_unit"] = unit
        table["acc_begin"] = acc_begin
        table["acc_end"] = acc_end
        table["read_offset"] = read_offset
        table["read_length"] = read_length
        table["dst"] = dst
        return cls(table)

    def rebased(self, base: int) -> BlockArray:
        """The same blocks with ``base`` added to every ``dst`` (offsets into a buffer -> addresses)."""
        table = self.table.copy()
        table["dst"] += np.uint64(base)
        return BlockArray(table)

    def __len__(self) -> int:
        return len(self.table)

    @overload
    def __getitem__(self, index: int) -> Block: ...

    @overload
    def __getitem__(self, index: slice) -> BlockArray: ...

    def __getitem__(self, index: int | slice) -> Block | BlockArray:
        if isinstance(index, slice):
            return BlockArray(self.table[index])
        return Block(*(int(value) for value in self.table[index].tolist()))

    def __iter__(self) -> Iterator[Block]:
        for row in self.table.tolist():
            yield Block(*row)

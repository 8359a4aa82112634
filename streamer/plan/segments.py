"""Cuts tensors into equal, independent reads.

Reads are sized by ``block_size``, not by tensors: a large tensor spans many
blocks (so many threads share it) and small neighbours share one block. Blocks
are grouped into segments, each backed by one destination buffer that mirrors
a contiguous range of one file; segments bound how much memory is committed at
once when a memory limit applies.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

from streamer.engine.blocks import Block, Unit

T = TypeVar("T")


class Segment(NamedTuple):
    """A run of consecutive units of one file, read into one buffer.

    The buffer mirrors file bytes ``[buffer_begin, buffer_end)``; both are aligned so
    that O_DIRECT reads land on aligned addresses. Block ``dst`` fields are offsets
    into that buffer until the run driver adds the buffer's address.
    """

    file: int
    first_unit: int
    last_unit: int  # inclusive
    buffer_begin: int
    buffer_end: int
    blocks: tuple[Block, ...]

    @property
    def size(self) -> int:
        return self.buffer_end - self.buffer_begin

    @property
    def unit_count(self) -> int:
        return self.last_unit - self.first_unit + 1

    def read_extents(self) -> list[tuple[int, int]]:
        """The parts of the buffer its blocks fill (offsets into it), adjacent blocks joined."""
        extents: list[tuple[int, int]] = []
        for block in self.blocks:
            if extents and extents[-1][1] == block.dst:
                extents[-1] = (extents[-1][0], block.dst + block.read_length)
            else:
                extents.append((block.dst, block.dst + block.read_length))
        return extents

    def filled_extent(self, page: int) -> tuple[int, int] | None:
        """The one extent of the buffer its blocks fill, when they tile it in whole ``page``s (so it
        may be read through the page fill); None when they leave gaps or share a page."""
        extents = self.read_extents()
        if len(extents) != 1 or any((block.dst | block.read_length) % page for block in self.blocks):
            return None
        return extents[0]


def align_down(value: int, alignment: int) -> int:
    return value - value % alignment


def align_up(value: int, alignment: int) -> int:
    return align_down(value + alignment - 1, alignment)


def plan_segments(
    units: Sequence[Unit],
    *,
    block_size: int,
    segment_bytes: int | None,
    alignment: int,
    request_bytes: int | None = None,
    file_grid: bool = False,
) -> list[Segment]:
    """Groups units (sorted by file, then offset) into segments of at most ``segment_bytes``.

    A unit larger than ``segment_bytes`` gets a segment of its own. Each block reads the aligned
    extent of the units it touches, cut where units are at least ``request_bytes`` apart (what
    one more request costs the storage; None: never cut). Units that follow each other (a whole
    checkpoint) are read in whole blocks of the ``block_size`` grid; the ranges of a sliced read
    only where they are. ``file_grid``: the grid lines are the multiples of ``block_size`` in
    file offsets (a storage caching on that grid), not counted from each segment's start.
    """

    def joins(first: Unit, previous: Unit, unit: Unit) -> bool:
        return unit.file == first.file and (segment_bytes is None or unit.end - first.begin <= segment_bytes)

    return [
        _plan_segment(units, start, stop, block_size, alignment, request_bytes, file_grid)
        for start, stop in stretches(units, joins)
    ]


def stretches(items: Sequence[T], joins: Callable[[T, T, T], bool]) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of each longest stretch of ``items`` whose every next item ``joins`` it
    (asked with the stretch's first item, the item before and the item itself)."""
    start = 0
    while start < len(items):
        stop = start + 1
        while stop < len(items) and joins(items[start], items[stop - 1], items[stop]):
            stop += 1
        yield start, stop
        start = stop


def _plan_segment(
    units: Sequence[Unit],
    start: int,
    stop: int,
    block_size: int,
    alignment: int,
    request_bytes: int | None,
    file_grid: bool,
) -> Segment:
    first, last = units[start], units[stop - 1]
    buffer_begin = align_down(first.begin, alignment)
    buffer_end = align_up(last.end, alignment)
    begins = [u.begin for u in units[start:stop]]
    ends = [u.end for u in units[start:stop]]
    # Pieces at least two aligned blocks apart never read the same aligned block.
    min_gap = None if request_bytes is None else max(request_bytes, 2 * alignment)
    blocks: list[Block] = []
    grid_start = buffer_begin - buffer_begin % block_size if file_grid else buffer_begin
    for grid_line in range(grid_start, buffer_end, block_size):
        grid_offset = max(grid_line, buffer_begin)
        grid_end = min(grid_line + block_size, buffer_end)
        # Units overlapping the block: those ending after its start and starting before its end.
        lo = bisect.bisect_right(ends, grid_offset)
        hi = bisect.bisect_left(begins, grid_end) - 1
        for piece_lo, piece_hi in _pieces(begins, ends, lo, hi, min_gap):
            acc_begin = max(grid_offset, begins[piece_lo])
            acc_end = min(grid_end, ends[piece_hi])
            read_offset = max(grid_offset, align_down(acc_begin, alignment))
            read_end = min(grid_end, align_up(acc_end, alignment))
            blocks.append(
                Block(
                    file=first.file,
                    first_unit=start + piece_lo,
                    last_unit=start + piece_hi,
                    acc_begin=acc_begin,
                    acc_end=acc_end,
                    read_offset=read_offset,
                    read_length=read_end - read_offset,
                    dst=read_offset - buffer_begin,
                )
            )
    return Segment(first.file, start, stop - 1, buffer_begin, buffer_end, tuple(blocks))


def _pieces(
    begins: list[int], ends: list[int], lo: int, hi: int, min_gap: int | None
) -> list[tuple[int, int]]:
    """Units ``lo..hi`` (inclusive; none if ``lo > hi``) in runs cut at gaps of ``min_gap`` or more."""
    if lo > hi:
        return []  # padding between tensors: nothing to read
    if min_gap is None:
        return [(lo, hi)]
    pieces = [(lo, lo)]
    for unit in range(lo + 1, hi + 1):
        if begins[unit] - ends[unit - 1] >= min_gap:
            pieces.append((unit, unit))
        else:
            pieces[-1] = (pieces[-1][0], unit)
    return pieces


class Span(NamedTuple):
    """A byte range ``[begin, end)`` of one file (a run of tensors to read, or a copy destination)."""

    file: int
    begin: int
    end: int


class SlotRead(NamedTuple):
    """Up to one ring slot of a file: read into a slot, then copied out of it as a whole.

    The slot holds file bytes ``[read_begin, read_end)`` (aligned for O_DIRECT); only
    ``[begin, end)`` are wanted. Block ``dst`` fields are offsets into the slot. SlotRead ``i``
    is the engine's unit ``i``: it completes when its wanted bytes are all read.
    """

    file: int
    begin: int
    end: int
    read_begin: int
    read_end: int
    blocks: tuple[Block, ...]


def group_spans(spans: Sequence[Span], *, max_gap: int) -> list[Span]:
    """Merges spans (sorted by file, then offset) of one file that are at most ``max_gap`` apart.

    Reading a small gap costs less than another read and another destination allocation.
    """
    groups: list[Span] = []
    for span in spans:
        last = groups[-1] if groups else None
        if last is not None and last.file == span.file and span.begin - last.end <= max_gap:
            groups[-1] = Span(last.file, last.begin, max(last.end, span.end))
        else:
            groups.append(span)
    return groups


def plan_slot_reads(
    regions: Sequence[Span], *, slot_size: int, block_size: int, alignment: int
) -> list[SlotRead]:
    """Cuts each region into slot-sized pieces at aligned offsets, regardless of tensor boundaries.

    ``slot_size`` must be a multiple of ``alignment``; regions must be at least ``2 * alignment``
    apart so that no two pieces read the same aligned block.
    """
    step = min(block_size, slot_size)
    pieces: list[SlotRead] = []
    for region in regions:
        read_begin = align_down(region.begin, alignment)
        read_stop = align_up(region.end, alignment)
        for start in range(read_begin, read_stop, slot_size):
            stop = min(start + slot_size, read_stop)
            begin, end = max(start, region.begin), min(stop, region.end)
            unit = len(pieces)
            blocks = tuple(
                Block(
                    file=region.file,
                    first_unit=unit,
                    last_unit=unit,
                    acc_begin=max(offset, begin),
                    acc_end=min(offset + step, end),
                    read_offset=offset,
                    read_length=min(step, stop - offset),
                    dst=offset - start,
                )
                for offset in range(start, stop, step)
                if max(offset, begin) < min(offset + step, end)
            )
            pieces.append(SlotRead(region.file, begin, end, start, stop, blocks))
    return pieces

"""Cuts tensors into equal, independent reads.

Reads are sized by ``block_size``, not by tensors: a large tensor spans many
blocks (so many threads share it) and small neighbours share one block. Blocks
are grouped into segments, each backed by one destination buffer that mirrors
a contiguous range of one file; segments bound how much memory is committed at
once when a memory limit applies.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from streamer.engine.blocks import Block, Unit


@dataclass(frozen=True)
class Segment:
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


def align_down(value: int, alignment: int) -> int:
    return value - value % alignment


def align_up(value: int, alignment: int) -> int:
    return align_down(value + alignment - 1, alignment)


def plan_segments(
    units: Sequence[Unit], *, block_size: int, segment_bytes: int | None, alignment: int
) -> list[Segment]:
    """Groups units (sorted by file, then offset) into segments of at most ``segment_bytes``.

    A unit larger than ``segment_bytes`` gets a segment of its own.
    """
    segments: list[Segment] = []
    start = 0
    while start < len(units):
        stop = start + 1
        while (
            stop < len(units)
            and units[stop].file == units[start].file
            and (segment_bytes is None or units[stop].end - units[start].begin <= segment_bytes)
        ):
            stop += 1
        segments.append(_plan_segment(units, start, stop, block_size, alignment))
        start = stop
    return segments


def _plan_segment(units: Sequence[Unit], start: int, stop: int, block_size: int, alignment: int) -> Segment:
    first, last = units[start], units[stop - 1]
    buffer_begin = align_down(first.begin, alignment)
    buffer_end = align_up(last.end, alignment)
    begins = [u.begin for u in units[start:stop]]
    ends = [u.end for u in units[start:stop]]
    blocks: list[Block] = []
    for read_offset in range(buffer_begin, buffer_end, block_size):
        read_end = min(read_offset + block_size, buffer_end)
        acc_begin, acc_end = max(read_offset, first.begin), min(read_end, last.end)
        # Units overlapping [acc_begin, acc_end): those ending after acc_begin and starting before acc_end.
        lo = bisect.bisect_right(ends, acc_begin)
        hi = bisect.bisect_left(begins, acc_end) - 1
        if lo > hi:
            continue  # padding between tensors: nothing to read
        blocks.append(
            Block(
                file=first.file,
                first_unit=start + lo,
                last_unit=start + hi,
                acc_begin=acc_begin,
                acc_end=acc_end,
                read_offset=read_offset,
                read_length=read_end - read_offset,
                dst=read_offset - buffer_begin,
            )
        )
    return Segment(first.file, start, stop - 1, buffer_begin, buffer_end, tuple(blocks))


@dataclass(frozen=True)
class Span:
    """A byte range ``[begin, end)`` of one file (a run of tensors to read, or a copy destination)."""

    file: int
    begin: int
    end: int


@dataclass(frozen=True)
class Piece:
    """Up to one ring slot of a file: read into a slot, then copied out of it as a whole.

    The slot holds file bytes ``[read_begin, read_end)`` (aligned for O_DIRECT); only
    ``[begin, end)`` are wanted. Block ``dst`` fields are offsets into the slot. Piece ``i``
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


def plan_pieces(regions: Sequence[Span], *, slot_size: int, block_size: int, alignment: int) -> list[Piece]:
    """Cuts each region into slot-sized pieces at aligned offsets, regardless of tensor boundaries.

    ``slot_size`` must be a multiple of ``alignment``; regions must be at least ``2 * alignment``
    apart so that no two pieces read the same aligned block.
    """
    step = min(block_size, slot_size)
    pieces: list[Piece] = []
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
            pieces.append(Piece(region.file, begin, end, start, stop, blocks))
    return pieces

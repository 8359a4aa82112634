"""The group plan: which rank reads which bytes, and in what order the pieces are exchanged.

Pure and deterministic (the same inputs give the same plan on every rank). Each rank wants its
own byte spans (whole tensors, or slices of them; ranks may want different ones). The union of
the wanted bytes is merged into contiguous ranges per file (bytes no one wants are not read),
cut into pieces of at most ``piece_bytes``, and the pieces, in file and offset order, are dealt
out as contiguous, byte-balanced shares: rank ``r`` reads the pieces whose middle byte falls in
its ``1/N`` of the total. Pieces are exchanged round-robin over the shares (rank 0's first,
rank 1's first, ...), so every rank reads from the start and no rank waits for another's whole
share. A piece goes from its reader to the ranks that want some of it, and to no other.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

Want = tuple[int, int, int]
"""``(file, begin, end)``: bytes a rank wants, as one tensor or slice of its own."""


@dataclass(frozen=True)
class Part:
    """Bytes of one rank's wanted span that a piece holds."""

    rank: int
    position: int  # index of the span in that rank's wants
    tensor_offset: int  # where they go in the span
    piece_offset: int  # where they are in the piece
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """One contiguous byte range of one file, read by one rank and sent to the ranks that want it."""

    file: int
    begin: int
    end: int
    reader: int
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def wanted_by(self) -> tuple[int, ...]:
        return tuple(sorted({part.rank for part in self.parts}))


@dataclass(frozen=True)
class GroupPlan:
    pieces: tuple[Piece, ...]  # in exchange order
    world_size: int

    def share(self, rank: int) -> list[int]:
        """Indices (into ``pieces``) of what ``rank`` reads, in exchange order."""
        return [i for i, piece in enumerate(self.pieces) if piece.reader == rank]

    def share_bytes(self, rank: int) -> int:
        return sum(p.nbytes for p in self.pieces if p.reader == rank)

    def rounds(self) -> list[range]:
        """The pieces (indices) exchanged together, ``world_size`` at a time in exchange order:
        the ranks agree their reads succeeded once per round."""
        count, world = len(self.pieces), self.world_size
        return [range(first, min(first + world, count)) for first in range(0, count, world)]


def make_plan(wants: Sequence[Sequence[Want]], piece_bytes: int) -> GroupPlan:
    """Plans the exchange among ``len(wants)`` ranks; spans may overlap (slices of one tensor)."""
    world_size = len(wants)
    if world_size < 1 or piece_bytes < 1:
        raise ValueError(f"world_size and piece_bytes must be positive, got {world_size}, {piece_bytes}")
    ranges = _pieces(coalesced([span for spans in wants for span in spans]), piece_bytes)
    total = sum(end - begin for _, begin, end in ranges)
    starts = [(file, begin) for file, begin, _ in ranges]
    parts: list[list[Part]] = [[] for _ in ranges]
    for rank, spans in enumerate(wants):
        for position, (file, first, last) in enumerate(spans):
            index = bisect.bisect_right(starts, (file, first)) - 1
            while (
                first < last and index < len(ranges) and ranges[index][0] == file and ranges[index][1] < last
            ):
                _, begin, end = ranges[index]
                low, high = max(begin, first), min(end, last)
                if low < high:
                    parts[index].append(Part(rank, position, low - first, low - begin, high - low))
                index += 1
    shares: list[list[Piece]] = [[] for _ in range(world_size)]
    done = 0
    for (file, begin, end), held in zip(ranges, parts, strict=True):
        reader = min(world_size - 1, (2 * done + end - begin) * world_size // (2 * total))  # by its middle
        shares[reader].append(Piece(file, begin, end, reader, tuple(held)))
        done += end - begin
    exchange = [
        share[i]
        for i in range(max((len(s) for s in shares), default=0))
        for share in shares
        if i < len(share)
    ]
    return GroupPlan(tuple(exchange), world_size)


def union_bytes(wants: Sequence[Sequence[Want]]) -> int:
    """Bytes at least one rank wants: what the group reads."""
    return sum(end - begin for _, begin, end in coalesced([span for spans in wants for span in spans]))


def coalesced(spans: Sequence[Want]) -> list[Want]:
    """The wanted bytes as disjoint ``(file, begin, end)`` ranges in file and offset order;
    touching ranges are joined (they can be read as one)."""
    merged: list[Want] = []
    for file, begin, end in sorted(span for span in spans if span[2] > span[1]):
        if merged and merged[-1][0] == file and begin <= merged[-1][2]:
            last = merged[-1]
            merged[-1] = (file, last[1], max(last[2], end))
        else:
            merged.append((file, begin, end))
    return merged


def _pieces(ranges: list[Want], piece_bytes: int) -> list[Want]:
    return [
        (file, start, min(end, start + piece_bytes))
        for file, begin, end in ranges
        for start in range(begin, end, piece_bytes)
    ]

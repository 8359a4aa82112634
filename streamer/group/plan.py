"""The group plan: which rank reads which bytes, and in what order the pieces are exchanged.

Pure and deterministic (the same inputs give the same plan on every rank). The wanted bytes are
merged into contiguous ranges per file (bytes no one wants are not read), cut into pieces of at
most ``piece_bytes``, and the pieces, in file and offset order, are dealt out as contiguous,
byte-balanced shares: rank ``r`` reads the pieces whose middle byte falls in its ``1/N`` of the
total. Pieces are exchanged round-robin over the shares (rank 0's first, rank 1's first, ...),
so every rank reads from the start and no rank waits for another's whole share.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from streamer.checkpoint import TensorRef


@dataclass(frozen=True)
class Part:
    """Bytes of one wanted tensor that a piece holds."""

    position: int  # index of the tensor in the wanted refs
    tensor_offset: int  # where they go in the tensor
    piece_offset: int  # where they are in the piece
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """One contiguous byte range of one file, read by one rank and broadcast to the others."""

    file: int
    begin: int
    end: int
    reader: int
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class GroupPlan:
    pieces: tuple[Piece, ...]  # in exchange order
    world_size: int

    def share(self, rank: int) -> list[int]:
        """Indices (into ``pieces``) of what ``rank`` reads, in exchange order."""
        return [i for i, piece in enumerate(self.pieces) if piece.reader == rank]

    def share_bytes(self, rank: int) -> int:
        return sum(p.nbytes for p in self.pieces if p.reader == rank)

    def digest(self) -> int:
        """A 63-bit fingerprint: equal on two ranks only if they planned the same exchange."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr(self.world_size).encode())
        for p in self.pieces:
            h.update(repr((p.file, p.begin, p.end, p.reader, p.parts)).encode())
        return int.from_bytes(h.digest(), "little") >> 1


def make_plan(refs: Sequence[TensorRef], world_size: int, piece_bytes: int) -> GroupPlan:
    """Plans the exchange of ``refs`` (which may overlap: slices of one tensor) among the ranks."""
    if world_size < 1 or piece_bytes < 1:
        raise ValueError(f"world_size and piece_bytes must be positive, got {world_size}, {piece_bytes}")
    ranges = _pieces(_merged(refs), piece_bytes)
    total = sum(end - begin for _, begin, end in ranges)
    starts = [(file, begin) for file, begin, _ in ranges]
    parts: list[list[Part]] = [[] for _ in ranges]
    for position, ref in enumerate(refs):
        entry = ref.entry
        if entry.nbytes == 0:
            continue
        index = bisect.bisect_right(starts, (ref.file, entry.begin)) - 1
        while index < len(ranges) and ranges[index][0] == ref.file and ranges[index][1] < entry.end:
            _, begin, end = ranges[index]
            low, high = max(begin, entry.begin), min(end, entry.end)
            if low < high:
                parts[index].append(Part(position, low - entry.begin, low - begin, high - low))
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


def _merged(refs: Sequence[TensorRef]) -> list[tuple[int, int, int]]:
    """The wanted bytes as disjoint ``(file, begin, end)`` ranges in file and offset order;
    touching ranges are joined (they can be read as one)."""
    spans = sorted((r.file, r.entry.begin, r.entry.end) for r in refs if r.entry.nbytes > 0)
    merged: list[tuple[int, int, int]] = []
    for file, begin, end in spans:
        if merged and merged[-1][0] == file and begin <= merged[-1][2]:
            last = merged[-1]
            merged[-1] = (file, last[1], max(last[2], end))
        else:
            merged.append((file, begin, end))
    return merged


def _pieces(ranges: list[tuple[int, int, int]], piece_bytes: int) -> list[tuple[int, int, int]]:
    return [
        (file, start, min(end, start + piece_bytes))
        for file, begin, end in ranges
        for start in range(begin, end, piece_bytes)
    ]

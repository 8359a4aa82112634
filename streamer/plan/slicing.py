"""Which bytes a basic index of a tensor needs, and how to read them (pure planning for ``get_slice``).

An index made of ints, slices, ``...`` and ``None`` selects a strided view of the tensor. torch
itself computes that view on a ``meta`` tensor (no memory, no bytes), so the shapes, the
negative-index and clamping rules and every error are exactly torch's, which are safetensors'.
The view is then cut into *runs* (contiguous element ranges, in order, computed as numpy arrays
so that a column of 16384 rows costs no Python loop; numpy, not torch, because torch's intra-op
threads stall these small operations for milliseconds on a busy machine); runs closer than what
one more read request costs the storage (``ReadCost.request_bytes``) are read as one range, those
further apart as ranges of their own: the covering rows or strided ranges, whichever costs less.
The ranges are read back to back into one buffer (``packing``) and the runs gathered out of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from streamer.errors import PackedSliceError

MAX_RUNS = 1 << 20  # more runs than this are read as their covering range (8 bytes of index per run)


@dataclass(frozen=True)
class StridedView:
    """Where a selection sits: a strided view of the tensor, in elements of the tensor's dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ReadPlan:
    """Byte ranges of the file to read (sorted, disjoint), and the runs the selection is made of.

    ``range_table`` is an ``[n, 2]`` int64 array of ``(begin, end)``. The runs (``run_begins``:
    absolute byte offsets, int64, in the selection's row-major order, each ``run_bytes`` long)
    each lie inside one range; with one range and one run, the selection is that range exactly.
    """

    range_table: np.ndarray = field(compare=False)
    run_begins: np.ndarray = field(compare=False)
    run_bytes: int

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The ranges as ``(begin, end)`` pairs (a Python object per range: for inspection)."""
        return _pairs(self.range_table)

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The runs as ``(begin, end)`` pairs (a Python object per run: for inspection)."""
        return tuple((begin, begin + self.run_bytes) for begin in self.run_begins.tolist())


@dataclass(frozen=True)
class Packing:
    """A plan's ranges read back to back into one buffer, so that no per-range object is ever made.

    Each range is rounded out to ``alignment`` (O_DIRECT reads land aligned; the padding is read,
    never credited) and cut into reads of at most one block; read ``i`` fills buffer bytes
    ``[dst[i], dst[i] + read_length[i])`` from file offset ``read_offset[i]`` and credits file bytes
    ``[acc_begin[i], acc_end[i])``. ``run_offsets``: where each run of the plan starts in the buffer.
    """

    size: int
    need: int  # the bytes the ranges hold: what the reads credit
    acc_begin: np.ndarray
    acc_end: np.ndarray
    read_offset: np.ndarray
    read_length: np.ndarray
    dst: np.ndarray
    run_offsets: np.ndarray


def is_basic(index: object) -> bool:
    """Whether ``index`` selects a view (ints, slices of ints, ``...``, ``None``, or a tuple of them)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(_basic_item(item) for item in items)


def _basic_item(item: object) -> bool:
    if item is None or item is Ellipsis:
        return True
    if isinstance(item, slice):
        return all(_plain_int(part) or part is None for part in (item.start, item.stop, item.step))
    return _plain_int(item)


def _plain_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # torch reads True as a mask


def select(index: object, shape: tuple[int, ...]) -> StridedView:
    """The view ``tensor[index]`` is, for a basic ``index`` of a tensor of ``shape``; torch's errors."""
    view = torch.empty(shape, dtype=torch.uint8, device="meta")[index]  # type: ignore[index]
    return StridedView(tuple(view.shape), tuple(view.stride()), int(view.storage_offset()))


def pack(layout: StridedView, per_item: int, *, name: str, path: str) -> StridedView:
    """A layout in header values as one in torch elements of a packed dtype (``per_item`` values each).

    The selection must keep whole elements: the last dimension kept, step 1, on even bounds.
    """
    if per_item == 1:
        return layout
    shape, stride = layout.shape, layout.stride
    if not shape or stride[-1] != 1 or shape[-1] % per_item or layout.offset % per_item:
        raise PackedSliceError(
            f"this slice splits a packed element ({per_item} values per byte): keep the last dimension, "
            f"with step 1 and bounds that are multiples of {per_item}",
            path=path,
            tensor=name,
        )
    return StridedView(
        (*shape[:-1], shape[-1] // per_item),
        (*(s // per_item if n > 1 else s for n, s in zip(shape[:-1], stride[:-1], strict=True)), 1),
        layout.offset // per_item,
    )


def runs_of(layout: StridedView) -> list[tuple[int, int]] | None:
    """The selection's contiguous element ranges in row-major order; None beyond ``MAX_RUNS``."""
    found = run_starts(layout)
    if found is None:
        return None
    starts, length = found
    return [(start, start + length) for start in starts.tolist()]


def run_starts(layout: StridedView) -> tuple[np.ndarray, int] | None:
    """Where each run starts (int64, row-major order) and the elements in each; None beyond ``MAX_RUNS``."""
    if layout.numel == 0:
        return np.empty(0, dtype=np.int64), 0
    inner = 1
    outer = len(layout.shape)
    while outer > 0 and (layout.shape[outer - 1] == 1 or layout.stride[outer - 1] == inner):
        outer -= 1
        inner *= layout.shape[outer]
    if math.prod(layout.shape[:outer]) > MAX_RUNS:
        return None
    starts = np.full(1, layout.offset, dtype=np.int64)
    for n, stride in zip(layout.shape[:outer], layout.stride[:outer], strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    return starts, inner


def covering(layout: StridedView) -> tuple[int, int]:
    """The smallest element range holding the (non-empty) selection."""
    last = layout.offset + sum((n - 1) * s for n, s in zip(layout.shape, layout.stride, strict=True))
    return layout.offset, last + 1


def plan(layout: StridedView, *, base: int, itemsize: int, request_bytes: int) -> ReadPlan:
    """How to read a non-empty selection of the tensor whose bytes start at ``base``.

    ``request_bytes`` is what one more read request costs the storage (``ReadCost``): runs closer
    than that are read as one range (reading the gap costs less than skipping it), runs further
    apart as ranges of their own. So a column slice reads the covering rows where rows are short
    and strided ranges where they are long; never more than the covering range. Beyond
    ``MAX_RUNS`` runs, the covering range.
    """
    found = run_starts(layout)
    if found is None:
        lo, hi = covering(layout)
        whole = np.array([[base + lo * itemsize, base + hi * itemsize]], dtype=np.int64)
        return ReadPlan(whole, whole[:, 0].copy(), int(whole[0, 1] - whole[0, 0]))
    starts, length = found
    begins = base + starts * itemsize
    runs = np.stack((begins, begins + length * itemsize), axis=1)
    return ReadPlan(merged(runs, max_gap=request_bytes - 1), begins, length * itemsize)


def packing(plan: ReadPlan, *, alignment: int, block_size: int) -> Packing:
    """How to read ``plan``'s ranges into one buffer, ``alignment``-rounded, in reads of about
    ``block_size`` (rounded down to the alignment) at most."""
    step = max(alignment, block_size - block_size % alignment)
    begin, end = plan.range_table[:, 0].copy(), plan.range_table[:, 1].copy()
    lo = begin - begin % alignment
    hi = (end + alignment - 1) // alignment * alignment
    extent = hi - lo
    position = np.cumsum(extent) - extent  # where each range's aligned extent starts
    reads = (extent + step - 1) // step
    which = np.repeat(np.arange(len(extent)), reads)  # the range of each read
    first = np.cumsum(reads) - reads
    read_offset = lo[which] + (np.arange(len(which)) - first[which]) * step
    read_end = np.minimum(read_offset + step, hi[which])
    run_range = np.searchsorted(begin, plan.run_begins, side="right") - 1
    return Packing(
        size=int(extent.sum()),
        need=int((end - begin).sum()),
        acc_begin=np.maximum(read_offset, begin[which]),
        acc_end=np.minimum(read_end, end[which]),
        read_offset=read_offset,
        read_length=read_end - read_offset,
        dst=position[which] + read_offset - lo[which],
        run_offsets=position[run_range] + plan.run_begins - lo[run_range],
    )


def merged(runs: np.ndarray, *, max_gap: int) -> np.ndarray:
    """Sorted ranges (an ``[n, 2]`` int64 array) with gaps of at most ``max_gap`` joined."""
    if len(runs) < 2:
        return runs
    apart = np.flatnonzero(runs[1:, 0] - runs[:-1, 1] > max_gap)
    first = np.concatenate(([0], apart + 1))
    last = np.concatenate((apart, [len(runs) - 1]))
    return np.stack((runs[first, 0], runs[last, 1]), axis=1)


def merge(ranges: tuple[tuple[int, int], ...], *, max_gap: int) -> list[tuple[int, int]]:
    """Sorted ranges with gaps of at most ``max_gap`` joined."""
    if not ranges:
        return []
    return list(_pairs(merged(np.array(ranges, dtype=np.int64), max_gap=max_gap)))


def _pairs(ranges: np.ndarray) -> tuple[tuple[int, int], ...]:
    return tuple((begin, end) for begin, end in ranges.tolist())

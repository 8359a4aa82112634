"""Which bytes a basic index of a tensor needs, and how to read them (pure planning for ``get_slice``).

An index made of ints, slices, ``...`` and ``None`` selects a strided view of the tensor. torch
itself computes that view on a ``meta`` tensor (no memory, no bytes), so the shapes, the
negative-index and clamping rules and every error are exactly torch's, which are safetensors'.
The view is then cut into *runs* (contiguous element ranges, in order, computed as tensors so
that a column of 16384 rows costs no Python loop); runs closer than what one more read request
costs the storage (``ReadCost.request_bytes``) are read as one range, those further apart as
ranges of their own: the covering rows or strided ranges, whichever costs less.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from streamer.errors import PackedSliceError

MAX_RUNS = 1 << 20  # more runs than this are read as their covering range (8 bytes of index per run)


@dataclass(frozen=True)
class Layout:
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

    The runs (``run_begins``: absolute byte offsets, int64, in the selection's row-major order,
    each ``run_bytes`` long) each lie inside one range; with one range and one run, the selection
    is that range exactly.
    """

    ranges: tuple[tuple[int, int], ...]
    run_begins: torch.Tensor = field(compare=False)
    run_bytes: int

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The runs as ``(begin, end)`` pairs (a Python object per run: for inspection)."""
        return tuple((begin, begin + self.run_bytes) for begin in self.run_begins.tolist())


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


def select(index: object, shape: tuple[int, ...]) -> Layout:
    """The view ``tensor[index]`` is, for a basic ``index`` of a tensor of ``shape``; torch's errors."""
    view = torch.empty(shape, dtype=torch.uint8, device="meta")[index]  # type: ignore[index]
    return Layout(tuple(view.shape), tuple(view.stride()), int(view.storage_offset()))


def pack(layout: Layout, per_item: int, *, name: str, path: str) -> Layout:
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
    return Layout(
        (*shape[:-1], shape[-1] // per_item),
        (*(s // per_item if n > 1 else s for n, s in zip(shape[:-1], stride[:-1], strict=True)), 1),
        layout.offset // per_item,
    )


def runs_of(layout: Layout) -> list[tuple[int, int]] | None:
    """The selection's contiguous element ranges in row-major order; None beyond ``MAX_RUNS``."""
    found = run_starts(layout)
    if found is None:
        return None
    starts, length = found
    return [(start, start + length) for start in starts.tolist()]


def run_starts(layout: Layout) -> tuple[torch.Tensor, int] | None:
    """Where each run starts (int64, row-major order) and the elements in each; None beyond ``MAX_RUNS``."""
    if layout.numel == 0:
        return torch.empty(0, dtype=torch.int64), 0
    inner = 1
    outer = len(layout.shape)
    while outer > 0 and (layout.shape[outer - 1] == 1 or layout.stride[outer - 1] == inner):
        outer -= 1
        inner *= layout.shape[outer]
    if math.prod(layout.shape[:outer]) > MAX_RUNS:
        return None
    starts = torch.full((1,), layout.offset, dtype=torch.int64)
    for n, stride in zip(layout.shape[:outer], layout.stride[:outer], strict=True):
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
    return starts, inner


def covering(layout: Layout) -> tuple[int, int]:
    """The smallest element range holding the (non-empty) selection."""
    last = layout.offset + sum((n - 1) * s for n, s in zip(layout.shape, layout.stride, strict=True))
    return layout.offset, last + 1


def plan(layout: Layout, *, base: int, itemsize: int, request_bytes: int) -> ReadPlan:
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
        whole = (base + lo * itemsize, base + hi * itemsize)
        return ReadPlan((whole,), torch.tensor([whole[0]]), whole[1] - whole[0])
    starts, length = found
    begins = base + starts * itemsize
    runs = torch.stack((begins, begins + length * itemsize), dim=1)
    return ReadPlan(_pairs(merged(runs, max_gap=request_bytes - 1)), begins, length * itemsize)


def merged(runs: torch.Tensor, *, max_gap: int) -> torch.Tensor:
    """Sorted ranges (an ``[n, 2]`` int64 tensor) with gaps of at most ``max_gap`` joined."""
    if len(runs) < 2:
        return runs
    apart = torch.nonzero(runs[1:, 0] - runs[:-1, 1] > max_gap).reshape(-1)
    first = torch.cat((torch.zeros(1, dtype=torch.int64), apart + 1))
    last = torch.cat((apart, torch.tensor([len(runs) - 1])))
    return torch.stack((runs[first, 0], runs[last, 1]), dim=1)


def merge(ranges: tuple[tuple[int, int], ...], *, max_gap: int) -> list[tuple[int, int]]:
    """Sorted ranges with gaps of at most ``max_gap`` joined."""
    if not ranges:
        return []
    return list(_pairs(merged(torch.tensor(ranges, dtype=torch.int64), max_gap=max_gap)))


def _pairs(ranges: torch.Tensor) -> tuple[tuple[int, int], ...]:
    return tuple((begin, end) for begin, end in ranges.tolist())

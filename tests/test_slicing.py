"""The pure planning behind ``get_slice``: which elements an index selects, and which bytes to read."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer import PackedSliceError
from streamer.backends.base import LOCAL_CACHED_READ_COST, LOCAL_READ_COST, REMOTE_READ_COST
from streamer.engine.blocks import Unit
from streamer.plan.segments import align_down, align_up, plan_segments
from streamer.plan.slicing import (
    MAX_RUNS,
    StridedView,
    covering,
    is_basic,
    merge,
    pack,
    plan,
    runs_of,
    select,
)

KiB = 1 << 10
MiB = 1 << 20


def test_basic_indices_are_those_that_select_a_view() -> None:
    for index in (1, -1, slice(None), slice(1, None, 2), Ellipsis, None, (), (1, Ellipsis, None, slice(2))):
        assert is_basic(index), index
    for index in (True, [0], torch.tensor(1), 1.0, "a", (slice(None), [1]), slice(1.0, 2), (True,)):
        assert not is_basic(index), index


def test_select_is_torch_view_in_elements() -> None:
    assert select((slice(None), slice(2, 4)), (4, 6, 8)) == StridedView((4, 2, 8), (48, 8, 1), 16)
    assert select((1, Ellipsis, -1), (4, 6, 8)) == StridedView((6,), (8,), 48 + 7)
    with pytest.raises(IndexError, match="out of bounds"):
        select(4, (4, 6))


@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_runs_and_covering_hold_exactly_the_selection(shape: list[int], data: Any) -> None:
    index = tuple(
        data.draw(
            st.builds(
                slice,
                st.integers(-6, 6) | st.none(),
                st.integers(-6, 6) | st.none(),
                st.sampled_from([None, 1, 2]),
            )
        )
        for _ in shape
    )
    layout = select(index, tuple(shape))
    expected = torch.arange(max(1, torch.Size(shape).numel()))[: torch.Size(shape).numel()].reshape(shape)[
        index
    ]
    runs = runs_of(layout)
    assert runs is not None
    assert [e for begin, end in runs for e in range(begin, end)] == expected.reshape(-1).tolist()
    if expected.numel():
        lo, hi = covering(layout)
        assert (lo, hi - 1) == (expected.min().item(), expected.max().item())


def test_too_many_runs_are_not_listed() -> None:
    assert runs_of(select((slice(None), 0), (MAX_RUNS + 1, 2))) is None
    only_covering = plan(select((slice(None), 0), (MAX_RUNS + 1, 2)), base=0, itemsize=1, request_bytes=1)
    assert only_covering.ranges == ((0, 2 * MAX_RUNS + 1),)


def test_pack_keeps_whole_bytes_only() -> None:
    layout = select((Ellipsis, slice(2, 6)), (3, 8))
    assert pack(layout, 2, name="t", path="p") == StridedView((3, 2), (4, 1), 1)
    assert pack(layout, 1, name="t", path="p") is layout
    for index in ((Ellipsis, slice(1, 3)), (Ellipsis, 2), (Ellipsis, slice(None, None, 2)), (Ellipsis, None)):
        with pytest.raises(PackedSliceError, match="'t'"):
            pack(select(index, (3, 8)), 2, name="t", path="p")


def test_merge_joins_gaps_that_hold_no_block() -> None:
    assert merge(((0, 10), (15, 20), (100, 110)), max_gap=5) == [(0, 20), (100, 110)]


def test_plan_reads_rows_as_one_range_and_far_runs_one_by_one() -> None:
    rows = plan(select(slice(2, 4), (8, 1024)), base=100, itemsize=2, request_bytes=64 * KiB)
    assert rows.ranges == rows.runs == ((100 + 2 * 2048, 100 + 4 * 2048),)
    # Columns of narrow rows: gaps smaller than a block, so one covering range.
    narrow = plan(select((slice(None), slice(0, 8)), (64, 1024)), base=0, itemsize=4, request_bytes=64 * KiB)
    assert narrow.ranges == ((0, 63 * 4096 + 32),) and len(narrow.runs) == 64
    # Runs a MiB apart: read one by one.
    far = plan(
        select((slice(None), slice(0, 1024)), (4, 1 << 20)), base=0, itemsize=1, request_bytes=64 * KiB
    )
    assert far.ranges == far.runs == tuple((i << 20, (i << 20) + 1024) for i in range(4))
    # Some runs close, some far: the close ones share a range.
    mixed = plan(select((slice(None), slice(0, 2)), (4, 8)), base=0, itemsize=1, request_bytes=7)
    assert mixed.ranges == ((0, 26),) and len(mixed.runs) == 4
    apart = plan(select((slice(None), slice(0, 2)), (4, 8)), base=0, itemsize=1, request_bytes=6)
    assert apart.ranges == apart.runs == ((0, 2), (8, 10), (16, 18), (24, 26))


def test_the_choice_follows_the_storage_read_cost() -> None:
    """Columns of 32 KiB rows (28 KiB gaps): strided where a request costs less than the gap (local
    files in the page cache), the covering rows where it costs more (the local device, S3); rows
    of 8 MiB are strided on all three."""
    short = select((slice(None), slice(0, 4096)), (64, 32 * KiB))
    cached = plan(short, base=0, itemsize=1, request_bytes=LOCAL_CACHED_READ_COST.request_bytes)
    assert cached.ranges == cached.runs and len(cached.ranges) == 64
    for cost in (LOCAL_READ_COST, REMOTE_READ_COST):
        covering = plan(short, base=0, itemsize=1, request_bytes=cost.request_bytes)
        assert covering.ranges == ((0, 63 * 32 * KiB + 4096),) and len(covering.runs) == 64
    long = select((slice(None), slice(0, 1 << 20)), (4, 8 << 20))
    for cost in (LOCAL_CACHED_READ_COST, LOCAL_READ_COST, REMOTE_READ_COST):
        assert len(plan(long, base=0, itemsize=1, request_bytes=cost.request_bytes).ranges) == 4
    costs = (LOCAL_CACHED_READ_COST, LOCAL_READ_COST, REMOTE_READ_COST)
    assert [c.request_bytes for c in costs] == sorted({c.request_bytes for c in costs})


def test_many_runs_are_planned_without_a_covering_cliff() -> None:
    """16384 rows (four times the old limit) of 64 KiB, a column of 8 KiB each: 16384 strided ranges."""
    layout = select((slice(None), slice(8192, 16384)), (16384, 64 * KiB))
    planned = plan(layout, base=100, itemsize=1, request_bytes=LOCAL_CACHED_READ_COST.request_bytes)
    assert len(planned.ranges) == 16384
    assert planned.ranges[-1] == (100 + 16383 * 64 * KiB + 8192, 100 + 16383 * 64 * KiB + 16384)
    assert sum(end - begin for begin, end in planned.ranges) == 16384 * 8192


def grid(units: list[Unit], block_size: int, alignment: int) -> list[tuple[int, int]]:
    """Reads on the ``block_size`` grid from the aligned start of contiguous units (the plan of a
    whole checkpoint before reads followed the units)."""
    begin, end = align_down(units[0].begin, alignment), align_up(units[-1].end, alignment)
    return [(offset, min(offset + block_size, end) - offset) for offset in range(begin, end, block_size)]


@pytest.mark.parametrize(
    "request_bytes", [None, LOCAL_READ_COST.request_bytes, REMOTE_READ_COST.request_bytes]
)
def test_a_contiguous_checkpoint_is_planned_in_whole_grid_blocks(request_bytes: int | None) -> None:
    sizes = [5, 4096, 3 * MiB + 17, 100, 70 * KiB, 9 * MiB, 1]
    units, position = [], 8 + 37  # tensors follow each other from an unaligned header end
    for size in sizes:
        units.append(Unit(0, position, position + size))
        position += size
    for block_size, segment_bytes in ((8 * MiB, None), (64 * KiB, None), (1 * MiB, 4 * MiB)):
        segments = plan_segments(
            units,
            block_size=block_size,
            segment_bytes=segment_bytes,
            alignment=4096,
            request_bytes=request_bytes,
        )
        for segment in segments:
            mine = units[segment.first_unit : segment.last_unit + 1]
            got = [(b.read_offset, b.read_length) for b in segment.blocks]
            assert got == grid(mine, block_size, 4096)
            assert [(b.acc_begin, b.acc_end) for b in segment.blocks] == [
                (max(offset, mine[0].begin), min(offset + length, mine[-1].end)) for offset, length in got
            ]
            assert segment.read_extents() == [(0, segment.size)]


def test_blocks_follow_the_wanted_ranges() -> None:
    """Ranges of a sliced read: each block reads the aligned extent of the units it touches, cut
    where units are a request's cost apart; a block no unit touches is not read."""
    units = [Unit(0, 70000, 71000), Unit(0, 75000, 76000), Unit(0, 200000, 201000)]
    cheap = plan_segments(
        units, block_size=64 * KiB, segment_bytes=None, alignment=4096, request_bytes=16 * KiB
    )
    (segment,) = cheap
    assert segment.buffer_begin == 69632
    blocks = [
        (b.read_offset, b.read_offset + b.read_length, b.first_unit, b.last_unit) for b in segment.blocks
    ]
    # Units 0 and 1 are 4000 bytes apart: one read; unit 2 straddles a grid line: two reads.
    assert blocks == [(69632, 77824, 0, 1), (196608, 200704, 2, 2), (200704, 204800, 2, 2)]
    assert segment.read_extents() == [(0, 8192), (126976, 135168)]
    dear = plan_segments(units, block_size=64 * KiB, segment_bytes=None, alignment=4096, request_bytes=1)
    # Never closer than two aligned blocks: 4000 bytes apart still share one read.
    assert (dear[0].blocks[0].read_offset, dear[0].blocks[0].read_length) == (69632, 8192)
    apart = [Unit(0, 0, 1000), Unit(0, 40000, 41000)]
    split = plan_segments(
        apart, block_size=64 * KiB, segment_bytes=None, alignment=4096, request_bytes=16 * KiB
    )
    assert [(b.read_offset, b.read_length) for b in split[0].blocks] == [(0, 4096), (36864, 8192)]
    whole = plan_segments(
        apart, block_size=64 * KiB, segment_bytes=None, alignment=4096, request_bytes=64 * KiB
    )
    assert [(b.read_offset, b.read_length) for b in whole[0].blocks] == [(0, 45056)]


@pytest.mark.parametrize("segment_bytes", [None, 3 * MiB])
def test_a_file_grid_cuts_blocks_at_multiples_of_the_block_size(segment_bytes: int | None) -> None:
    """A cached storage's blocks: every cut falls on a multiple of ``block_size`` in the file (the
    cache's chunk grid), whatever the segments' starts; together they still cover every unit."""
    sizes = [5, 4096, 3 * MiB + 17, 100, 70 * KiB, 9 * MiB, 1]
    units, position = [], 8 + 37
    for size in sizes:
        units.append(Unit(0, position, position + size))
        position += size
    block_size = 1 * MiB
    segments = plan_segments(
        units,
        block_size=block_size,
        segment_bytes=segment_bytes,
        alignment=4096,
        request_bytes=REMOTE_READ_COST.request_bytes,
        file_grid=True,
    )
    covered = []
    for segment in segments:
        for block in segment.blocks:
            assert block.acc_begin // block_size == (block.acc_end - 1) // block_size  # within one line
            assert (
                block.read_offset // block_size == (block.read_offset + block.read_length - 1) // block_size
            )
            covered.append((block.acc_begin, block.acc_end))
    covered.sort()
    assert covered[0][0] == units[0].begin and covered[-1][1] == units[-1].end
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    whole = [b for s in segments for b in s.blocks if b.acc_end - b.acc_begin == block_size]
    assert all(b.acc_begin % block_size == 0 for b in whole) and len(whole) >= 10

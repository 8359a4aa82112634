"""The pure planning behind ``get_slice``: which elements an index selects, and which bytes to read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamer import PackedSliceError
from streamer.slicing import MAX_RUNS, Layout, covering, is_basic, merge, pack, plan, runs_of, select

KiB = 1 << 10


def test_basic_indices_are_those_that_select_a_view() -> None:
    for index in (1, -1, slice(None), slice(1, None, 2), Ellipsis, None, (), (1, Ellipsis, None, slice(2))):
        assert is_basic(index), index
    for index in (True, [0], torch.tensor(1), 1.0, "a", (slice(None), [1]), slice(1.0, 2), (True,)):
        assert not is_basic(index), index


def test_select_is_torch_view_in_elements() -> None:
    assert select((slice(None), slice(2, 4)), (4, 6, 8)) == Layout((4, 2, 8), (48, 8, 1), 16)
    assert select((1, Ellipsis, -1), (4, 6, 8)) == Layout((6,), (8,), 48 + 7)
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
    assert pack(layout, 2, name="t", path="p") == Layout((3, 2), (4, 1), 1)
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

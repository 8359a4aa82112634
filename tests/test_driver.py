"""The run driver with a third sink: what it promises every sink beyond the two it ships with.

``PeerSink`` works the way the group exchange (issue 14) will: it reads its own share of the
tensors through the run's reader, into memory of its own, and receives the others from a
"peer" (here: the reference bytes) once its reads are done. The driver must hand out both
kinds alike, in either order, read only what the sink asked for, and fail and close cleanly.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import (
    KiB,
    Written,
    assert_same,
    checkpoint_order,
    config,
    random_tensor,
    reference_load,
    settled_thread_count,
    thread_count,
    write_checkpoint,
)

from streamer import StreamerError
from streamer.backends.base import FileRead
from streamer.backends.local import LocalStorage
from streamer.destinations.buffers import empty_tensor
from streamer.engine import native
from streamer.observe.metrics import LoadMetrics
from streamer.plan.checkpoint import read_checkpoint
from streamer.plan.selection import Selection
from streamer.run.driver import Run, Submit


class PeerSink:
    """Reads the tensors at even positions; the odd ones arrive from a peer, last one first."""

    def __init__(
        self, selection: Selection, metrics: LoadMetrics, peer: dict[str, torch.Tensor], fail: bool
    ) -> None:
        self.refs = selection.refs
        self.peer = peer
        self.fail = fail
        self.own = [p for p in selection.positions() if p % 2 == 0]
        self.peer_share = [p for p in selection.positions() if p % 2 == 1]
        self.received = list(self.peer_share)
        engine_file = selection.engine_file()
        self.units = [native.Unit(engine_file[self.refs[p].file], *self._span(p)) for p in self.own]
        self.buffers: dict[int, torch.Tensor] = {}
        self.queued = False
        self.in_flight = 0
        self.done: list[int] = []
        self.tensors: dict[int, torch.Tensor] = {}
        self.closed = 0

    def plan(self) -> list[native.Unit]:
        return self.units

    def open_page_fill(self, file_reads: Sequence[FileRead]) -> native.PageFill | None:
        return None

    def submit_what_fits(self, submit: Submit) -> bool:
        if not self.queued:
            self.queued = True
            for unit, (file, begin, end, _need) in enumerate(self.units):
                buffer = torch.empty(end - begin, dtype=torch.uint8)
                self.buffers[self.own[unit]] = buffer
                self.in_flight += 1
                submit([native.Block(file, unit, unit, begin, end, begin, end - begin, 0)], buffer.data_ptr())
        return True

    busy = False  # nothing of its own runs beside the reads

    @property
    def reading(self) -> bool:
        return self.in_flight > 0

    def on_read(self, units: Sequence[int]) -> None:
        for unit in units:
            self.in_flight -= 1
            position = self.own[unit]
            entry = self.refs[position].entry
            buffer = self.buffers.pop(position)
            self.tensors[position] = buffer.view(entry.dtype.torch_dtype).view(entry.shape)
            self.done.append(position)

    def settle(self) -> None:
        """The peer's share arrives once this rank's reads are done."""
        if self.fail:
            raise StreamerError("the peer went away")
        for position in reversed(self.received):
            self.tensors[position] = self.peer[self.refs[position].entry.name].clone()
            self.done.append(position)
        self.received = []

    def completed(self) -> list[int]:
        done, self.done = self.done, []
        return done

    def tensor(self, position: int) -> torch.Tensor:
        entry = self.refs[position].entry
        return empty_tensor(entry) if entry.nbytes == 0 else self.tensors.pop(position)

    @property
    def peak_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.closed += 1
        self.buffers.clear()
        self.tensors.clear()

    def _span(self, position: int) -> tuple[int, int]:
        entry = self.refs[position].entry
        return entry.begin, entry.end


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    g = torch.Generator().manual_seed(41)
    tensors = {f"t.{i:02d}": random_tensor((1 + 3 * KiB * (i % 5),), torch.float32, g) for i in range(14)}
    tensors["t.07"] = torch.empty(0, 3)
    return write_checkpoint(tmp_path_factory.mktemp("driver"), tensors, shards=2)


def _run(written: Written, *, ordered: bool, fail: bool = False) -> tuple[Run, list[PeerSink]]:
    settings = config(io_mode="buffered")
    storage = LocalStorage(settings)  # holds nothing open: no close needed
    checkpoint = read_checkpoint(storage, written.index)
    reference = reference_load(written.shards)
    sinks: list[PeerSink] = []

    def sink_for(selection: Selection, metrics: LoadMetrics) -> PeerSink:
        sinks.append(PeerSink(selection, metrics, reference, fail))
        return sinks[-1]

    run = Run(checkpoint, list(checkpoint.refs()), settings, sink_for, ordered=ordered, storage=storage)
    return run, sinks


@pytest.mark.parametrize("ordered", [True, False])
def test_tensors_a_sink_did_not_read_are_handed_out_like_its_own(written: Written, ordered: bool) -> None:
    run, (sink,) = _run(written, ordered=ordered)
    order = checkpoint_order(written.shards)
    reference = reference_load(written.shards)
    got = list(run.results())
    for name, tensor in got:
        assert_same(tensor, reference[name], name)
    names = [name for name, _ in got]
    received = [sink.refs[p].entry.name for p in sink.peer_share]
    assert received and sink.own
    if ordered:
        assert names == order
    else:
        assert sorted(names) == sorted(order)
        assert names[-len(received) :] == received[::-1]  # the peer's share, in the order it came
    metrics = run.metrics.as_dict()
    assert metrics["bytes_read"] == sum(sink.refs[p].entry.nbytes for p in sink.own)  # its share only
    assert metrics["tensors"] == len(order) and metrics["seconds"] > 0
    assert sink.closed == 1
    run.close()  # idempotent
    assert sink.closed == 2 and run.metrics.as_dict() == metrics


def test_a_sink_error_ends_the_run_and_closes_reader_and_sink(written: Written) -> None:
    run, (sink,) = _run(written, ordered=True, fail=True)
    threads = thread_count()
    results = run.results()
    with pytest.raises(StreamerError, match="the peer went away"):
        for _ in results:
            pass
    assert sink.closed == 1
    assert settled_thread_count(threads) == threads  # the reader's threads are gone


def test_dropping_a_run_midway_closes_it(written: Written) -> None:
    run, (sink,) = _run(written, ordered=False)
    threads = thread_count()
    results = run.results()
    next(results)
    assert thread_count() > threads
    results.close()
    assert sink.closed == 1
    assert settled_thread_count(threads) == threads


def test_a_run_never_started_holds_nothing(written: Written) -> None:
    run, (sink,) = _run(written, ordered=True)
    run.close()
    assert sink.closed == 1
    assert run.metrics.as_dict()["seconds"] == 0.0

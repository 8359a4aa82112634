"""No reader thread, file descriptor or buffer outlives a load: after a full load, an early exit,
an error or ``get_tensor``, each repeated to catch slow leaks.

Threads are counted in /proc/self/task, which sees the engine's native pthreads (``threading``
only knows Python's own); descriptors in /proc/self/fd.
"""

from __future__ import annotations

import gc
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    KiB,
    MiB,
    Written,
    assert_same,
    config,
    fd_count,
    file_layout,
    open_files,
    random_tensor,
    thread_count,
    write_checkpoint,
)

import streamer
from streamer import ReadError, SourceError, StreamerError
from streamer.run.cpu import CpuSink

# Budgets here are small on purpose; the pipeline may warn that it went over one (see
# test_memory_limit.py for that behaviour). This file is about threads, descriptors and buffers.
pytestmark = pytest.mark.filterwarnings("ignore:memory_limit:RuntimeWarning")

REPEATS = 5
CONCURRENCY = 6  # more than this machine's cores: leaked workers would be obvious


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Written:
    g = torch.Generator().manual_seed(11)
    tensors = {f"w{i:02d}": random_tensor((64 * KiB,), torch.float32, g) for i in range(32)}  # 8 MiB
    tensors["scalar"] = torch.tensor(1.5)
    return write_checkpoint(tmp_path_factory.mktemp("res"), tensors, shards=2)


def _cfg(**overrides: Any) -> Any:
    values = {"concurrency": CONCURRENCY, "block_size": 16 * KiB}
    values.update(overrides)
    return config(**values)


@pytest.fixture
def baseline(ckpt: Written) -> Iterator[Callable[[str], None]]:
    """Warms up (torch's own thread pools, the engine library), then returns a checker that the
    process has exactly the threads and descriptors it had before."""
    streamer.load(ckpt.index, config=_cfg())
    assert_same(torch.ones(3) + 1, torch.full((3,), 2.0))
    gc.collect()
    threads, fds, files = thread_count(), fd_count(), open_files()

    def check(what: str) -> None:
        gc.collect()
        now_threads, now_fds = thread_count(), fd_count()
        assert now_threads == threads, f"{what}: {now_threads - threads} thread(s) leaked"
        assert now_fds == fds, f"{what}: descriptors changed: {sorted(set(open_files()) ^ set(files))}"

    yield check


def _repeat(check: Callable[[str], None], what: str, scenario: Callable[[], None]) -> None:
    for i in range(REPEATS):
        scenario()
        check(f"{what} (run {i + 1})")


def _budget_used(handle: streamer.Streamer) -> int:
    """Bytes of destination buffers still alive (white box: the run's memory budget). Zero once
    every tensor of the run is gone, so no buffer outlives its tensors."""
    run = handle._run
    assert run is not None
    sink = run._sink
    assert isinstance(sink, CpuSink)
    return sink._budget.used


def test_counting_sees_native_threads(ckpt: Written, baseline: Callable[[str], None]) -> None:
    """The method itself: the engine's workers show up while a load runs."""
    before = thread_count()
    with streamer.open(ckpt.index, config=_cfg(memory_limit=64 * KiB)) as s:
        it = iter(s)
        next(it)
        assert thread_count() >= before + CONCURRENCY
        assert fd_count() >= 2  # the two shards are open in the engine
        del it
    baseline("after a partial read")


def test_full_load(ckpt: Written, baseline: Callable[[str], None]) -> None:
    def scenario() -> None:
        got = streamer.load(ckpt.index, config=_cfg())
        assert len(got) == len(ckpt.tensors)

    _repeat(baseline, "load()", scenario)

    def streamed() -> None:
        with streamer.open(ckpt.index, config=_cfg(memory_limit=MiB)) as s:
            for _item in s:
                pass
            del _item
            assert _budget_used(s) == 0

    _repeat(baseline, "streamed iteration", streamed)


@pytest.mark.parametrize(
    "how",
    [
        "break",
        "break_with_block",
        "close",
        "close_then_drop",
        "drop_generator",
        "consumer_raises",
        "never_started",
    ],
)
def test_early_exit(ckpt: Written, baseline: Callable[[str], None], how: str) -> None:
    def scenario() -> None:
        s = streamer.open(ckpt.index, config=_cfg(memory_limit=MiB))
        if how == "break":
            for _name, _tensor in s:
                break
            del _tensor
        elif how == "break_with_block":
            with s:
                for _name, _tensor in s:
                    break
                del _tensor
        elif how == "close":
            it = iter(s)
            name, tensor = next(it)
            s.close()
            # The iterator is still referenced: the close itself must release everything.
            assert thread_count() <= threads_before, "close() left reader threads running"
            assert fd_count() <= fds_before, "close() left files open"
            assert_same(tensor, ckpt.tensors[name], name)  # what was handed out stays valid
            del tensor
            assert _budget_used(s) == 0, "buffers outlived their tensors"
            kept.append(it)
        elif how == "close_then_drop":
            it = iter(s)
            next(it)
            s.close()
            del it
        elif how == "drop_generator":
            it = iter(s)
            next(it)
            next(it)
            del it  # no close(): dropping the generator must stop the run
        elif how == "consumer_raises":
            with pytest.raises(KeyError), s:
                for _name, _tensor in s:
                    raise KeyError("consumer failed")
            del _tensor
        elif how == "never_started":
            iter(s)  # a generator that never ran holds nothing
            s.close()
        gc.collect()
        if how != "close":
            assert _budget_used(s) == 0 or how == "never_started", "buffers outlived their tensors"

    threads_before, fds_before = thread_count(), fd_count()
    kept: list[Any] = []
    _repeat(baseline, how, scenario)


def _truncated_copy(ckpt: Written, directory: Path) -> Path:
    shard = ckpt.shards[0]
    copy = directory / "truncated.safetensors"
    shutil.copy(shard, copy)
    return copy


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_errors(ckpt: Written, baseline: Callable[[str], None], tmp_path: Path, io_mode: str) -> None:
    copy = _truncated_copy(ckpt, tmp_path)
    layout = file_layout(copy)
    cut = layout[len(layout) // 2][1] + 100
    size = copy.stat().st_size

    def mid_read() -> None:
        shutil.copy(ckpt.shards[0], copy)
        s = streamer.open(copy, config=_cfg(io_mode=io_mode))
        with open(copy, "r+b") as f:
            f.truncate(cut)
        with pytest.raises(ReadError), s:
            for _ in s:
                pass

    _repeat(baseline, "ReadError during iteration", mid_read)

    def mid_read_streaming() -> None:
        shutil.copy(ckpt.shards[0], copy)
        with streamer.open(copy, config=_cfg(io_mode=io_mode, memory_limit=MiB)) as s:
            got = 0
            with pytest.raises(ReadError):
                for _ in s:
                    got += 1
                    if got == 2:
                        with open(copy, "r+b") as f:
                            f.truncate(cut)

    _repeat(baseline, "ReadError after tensors were delivered", mid_read_streaming)

    def get_tensor() -> None:
        shutil.copy(ckpt.shards[0], copy)
        s = streamer.open(copy, config=_cfg(io_mode=io_mode))
        with open(copy, "r+b") as f:
            f.truncate(cut)
        with pytest.raises(ReadError):
            s.get_tensor(layout[-1][0])

    _repeat(baseline, "ReadError in get_tensor", get_tensor)

    def vanished() -> None:
        shutil.copy(ckpt.shards[0], copy)
        s = streamer.open(copy, config=_cfg(io_mode=io_mode))
        copy.unlink()  # gone between open and read: the engine cannot open it
        with pytest.raises(SourceError):
            list(s)

    _repeat(baseline, "file vanished before the read", vanished)
    assert size > cut


def test_errors_at_open(ckpt: Written, baseline: Callable[[str], None], tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")

    def scenario() -> None:
        for source in (bad, tmp_path / "missing.safetensors", [ckpt.shards[0], bad], tmp_path):
            with pytest.raises(streamer.StreamerError):
                streamer.load(source, config=_cfg())

    _repeat(baseline, "errors at open", scenario)


def test_get_tensor(ckpt: Written, baseline: Callable[[str], None]) -> None:
    def scenario() -> None:
        with streamer.open(ckpt.index, config=_cfg()) as s:
            for name in ("w00", "w17", "scalar", "w31"):
                assert_same(s.get_tensor(name), ckpt.tensors[name], name)
        s = streamer.open(ckpt.index, config=_cfg())  # without close() or a with block
        s.get_tensor("w05")

    _repeat(baseline, "get_tensor", scenario)


def test_many_loads_in_a_row(ckpt: Written, baseline: Callable[[str], None]) -> None:
    """A slow leak of one descriptor or thread per load shows up over many loads."""
    for _ in range(30):
        streamer.load(ckpt.shards[1], config=_cfg(concurrency=3))
        with streamer.open(ckpt.index, config=_cfg()) as s:
            next(iter(s))
    baseline("30 loads and 30 early exits")


def test_close_from_another_thread_mid_pass(ckpt: Written, baseline: Callable[[str], None]) -> None:
    """close() while another thread iterates waits for its next() in progress, then releases
    every thread, descriptor and buffer; that thread's pass ends with a StreamerError."""

    def scenario() -> None:
        s = streamer.open(ckpt.index, config=_cfg(memory_limit=MiB))
        handed = threading.Event()
        outcome: list[type[BaseException] | None] = []

        def consume() -> None:
            try:
                for _name, _tensor in s:
                    handed.set()
                    time.sleep(0.005)
                outcome.append(None)
            except BaseException as exc:  # judged below; its traceback would keep the last tensor
                outcome.append(type(exc))

        worker = threading.Thread(target=consume)
        worker.start()
        assert handed.wait(timeout=60)
        s.close()
        worker.join(timeout=60)
        assert not worker.is_alive()
        assert outcome in ([None], [StreamerError]), outcome
        gc.collect()
        assert _budget_used(s) == 0, "buffers outlived their tensors"

    _repeat(baseline, "close from another thread", scenario)

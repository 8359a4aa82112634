"""The storage contract, shown by a second storage (``faulty_storage.py``, one module): loads
through it are bit-exact on every path (CPU buffers, the staged ring, headers longer than the
front), each injected fault comes out as a typed error naming the file and the tensor, and no
thread or descriptor outlives a load, failed or abandoned."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import (
    Written,
    assert_same,
    assert_same_dict,
    config,
    fd_count,
    open_files,
    random_tensor,
    reference_load,
    thread_count,
    write_checkpoint,
)
from faulty_storage import SCHEME, Faults, FaultyStorage

import streamer
from streamer import backends
from streamer.backends.base import LOCAL_CACHED_READ_COST, LOCAL_READ_COST, REMOTE_READ_COST
from streamer.errors import ReadError, SourceError

KiB = 1024


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Written:
    generator = torch.Generator().manual_seed(12)
    tensors = {
        f"layer.{i}.weight": random_tensor((64, 1000 + 37 * i), torch.float32, generator) for i in range(6)
    }
    tensors["layer.bias"] = random_tensor((3,), torch.bfloat16, generator)
    tensors["empty"] = torch.empty((0, 4))
    return write_checkpoint(tmp_path_factory.mktemp("faulty"), tensors, shards=3)


@pytest.fixture
def faults() -> Iterator[Faults]:
    """Registers the faulty storage for ``faulty://`` with the faults the test sets."""
    chosen = Faults()
    backends.register(SCHEME, lambda _config: FaultyStorage(chosen))
    try:
        yield chosen
    finally:
        backends.unregister(SCHEME)


@pytest.fixture
def no_leaks(ckpt: Written) -> Iterator[Callable[[], None]]:
    """A checker that the process has the threads and descriptors it had before the test."""
    loaded = streamer.load(ckpt.shards[0], config=config())  # warm up: the engine library
    assert_same(next(iter(loaded.values())).clone(), next(iter(loaded.values())))  # torch's pools
    gc.collect()
    threads, fds, files = thread_count(), fd_count(), open_files()

    def check() -> None:
        gc.collect()
        assert thread_count() == threads, f"{thread_count() - threads} thread(s) leaked"
        assert fd_count() == fds, f"descriptors changed: {sorted(set(open_files()) ^ set(files))}"

    yield check


def uri(path: os.PathLike[str] | str) -> str:
    return f"{SCHEME}://{os.fspath(path)}"


def test_loads_bit_exact_through_a_second_storage(
    ckpt: Written, faults: Faults, no_leaks: Callable[[], None]
) -> None:
    assert ckpt.index is not None
    expected = reference_load(ckpt.shards)
    with streamer.open(uri(ckpt.index), config=config(), order="checkpoint") as handle:
        got = dict(handle)
        metrics = handle.metrics
    assert_same_dict(got, expected)
    assert list(got) == list(expected)  # checkpoint order: the index's shards, then offsets
    # Its own counters reach the run's metrics; none of the local storage's.
    assert metrics["requests"] >= metrics["blocks"] > 0
    assert metrics["direct_files"] == metrics["buffered_files"] == metrics["s3_files"] == 0
    no_leaks()


def test_get_slice_through_a_second_storage_uses_its_read_cost(
    ckpt: Written, faults: Faults, no_leaks: Callable[[], None]
) -> None:
    """A storage that states no cost is charged as a remote one: a column of these 4 KiB rows is
    read as its covering rows; with short reads on top, every bit still arrives."""
    faults.short_reads = True
    expected = reference_load(ckpt.shards)
    with streamer.safe_open(uri(ckpt.directory), config=config()) as handle:
        assert handle.handle.read_cost == REMOTE_READ_COST
        for name in ("layer.1.weight", "layer.4.weight"):
            assert_same(handle.get_slice(name)[:, 100:300], expected[name][:, 100:300], name)
            assert_same(handle.get_slice(name)[::3, -1], expected[name][::3, -1], name)
        metrics = handle.handle.metrics
        assert 0 < metrics["bytes_read"] <= expected["layer.4.weight"].nbytes
    no_leaks()


def test_slow_store_with_short_reads_still_loads_every_byte(
    ckpt: Written, faults: Faults, no_leaks: Callable[[], None]
) -> None:
    faults.delay = 0.002
    faults.short_reads = True
    with streamer.open(uri(ckpt.directory), config=config(memory_limit=768 * KiB)) as handle:
        got = {name: tensor.clone() for name, tensor in handle}  # streamed under a small budget
        metrics = handle.metrics
    assert_same_dict(got, reference_load(ckpt.shards))
    assert metrics["retries"] > 0, "every read was short: the rest was read again"
    no_leaks()


def test_staged_load_into_existing_tensors(
    ckpt: Written, faults: Faults, no_leaks: Callable[[], None]
) -> None:
    expected = reference_load(ckpt.shards)
    dest = {name: torch.full_like(tensor, 7) for name, tensor in expected.items()}
    streamer.load_into(dest, [uri(p) for p in ckpt.shards], config=config(memory_limit=128 * KiB))
    assert_same_dict(dest, expected)
    no_leaks()


def test_a_header_longer_than_the_front_is_read_with_more_ranges(
    tmp_path: os.PathLike[str], faults: Faults
) -> None:
    tensors = {
        f"a.very.long.tensor.name.to.make.the.header.long.{i:04d}": torch.full((2,), float(i))
        for i in range(200)
    }
    written = write_checkpoint(tmp_path, tensors, index=False)
    assert os.path.getsize(written.shards[0]) > 2 * 4096
    loaded = streamer.load(uri(written.shards[0]), config=config())
    assert_same_dict(loaded, tensors)


@pytest.mark.parametrize(
    ("fault", "message"),
    [("fail_after", "read failed: Input/output error"), ("vanish_after", "vanished during the load")],
)
def test_a_failing_store_raises_a_read_error_naming_file_and_tensor(
    ckpt: Written, faults: Faults, no_leaks: Callable[[], None], fault: str, message: str
) -> None:
    setattr(faults, fault, 300 * KiB)  # inside the first shard's second tensor
    with pytest.raises(ReadError, match=message) as info:
        streamer.load(uri(ckpt.shards[0]), config=config())
    error = info.value
    assert error.path == str(ckpt.shards[0])
    assert error.tensor is not None and error.tensor in ckpt.tensors
    assert error.offset is not None
    no_leaks()


def test_an_object_gone_before_the_read_is_a_source_error(
    tmp_path: os.PathLike[str], ckpt: Written, faults: Faults, no_leaks: Callable[[], None]
) -> None:
    written = write_checkpoint(tmp_path, {"x": torch.arange(1000.0)}, index=False)
    with streamer.open(uri(written.shards[0]), config=config()) as handle:
        written.shards[0].unlink()
        with pytest.raises(SourceError, match="cannot open") as info:
            handle["x"]
    assert info.value.path == str(written.shards[0])
    no_leaks()


def test_an_object_cut_short_during_the_load_names_the_tensor(
    tmp_path: os.PathLike[str], ckpt: Written, faults: Faults, no_leaks: Callable[[], None]
) -> None:
    written = write_checkpoint(tmp_path, {"a": torch.arange(1000.0), "b": torch.arange(5000.0)}, index=False)
    with streamer.open(uri(written.shards[0]), config=config()) as handle:
        os.truncate(written.shards[0], os.path.getsize(written.shards[0]) - 1000)
        with pytest.raises(ReadError, match="ended early") as info:
            dict(handle)
    assert info.value.tensor == "b"
    no_leaks()


def test_abandoning_a_slow_load_leaks_nothing(
    ckpt: Written, faults: Faults, no_leaks: Callable[[], None]
) -> None:
    faults.delay = 0.05
    handle = streamer.open(uri(ckpt.directory), config=config())
    name, tensor = next(iter(handle))
    assert_same(tensor, reference_load(ckpt.shards)[name])
    handle.close()
    no_leaks()


def test_sources_name_one_storage(ckpt: Written, faults: Faults) -> None:
    with pytest.raises(SourceError, match="no storage for nowhere://"):
        streamer.open("nowhere://bucket/model.safetensors")
    with pytest.raises(SourceError, match="not a mix"):
        streamer.open([uri(ckpt.shards[0]), str(ckpt.shards[1])])


def test_local_files_cost_more_per_request_from_the_device(tmp_path: Path) -> None:
    """Reads that go to the device (O_DIRECT) are charged the device's request cost; reads from the
    page cache (buffered) the cache's."""
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(64, 1024)}, str(path))
    for io_mode, cost in (("direct", LOCAL_READ_COST), ("buffered", LOCAL_CACHED_READ_COST)):
        with streamer.open(path, config=streamer.StreamerConfig(io_mode=io_mode)) as handle:
            assert handle.read_cost_of(handle.checkpoint.ref("w")) == cost

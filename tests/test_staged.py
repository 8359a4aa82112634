"""The staged (GPU) path on CPU: ring, backpressure, slot reuse, ordering, errors, ``load_into``.

A stand-in copy engine (tests/copy_standin.py) takes the GPU's place through the pipeline's
seam, so every test here runs without CUDA; tests/test_gpu.py repeats the essentials on a GPU.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from conftest import (
    TORCH_DTYPE,
    KiB,
    Written,
    assert_same,
    assert_same_dict,
    checkpoint_order,
    fd_count,
    random_tensor,
    raw_entry,
    reference_load,
    thread_count,
    write_checkpoint,
    write_raw,
)
from copy_standin import StandIn

import streamer
from streamer import ConfigError, DeviceError, ReadError, S3Config, SourceError, StreamerConfig
from streamer.backends.local import LocalStorage
from streamer.backends.s3.storage import S3Storage
from streamer.config import DIRECT_IO_ALIGNMENT
from streamer.destinations.copy_engine import CudaCopyEngine
from streamer.engine import native
from streamer.plan.segments import Span, group_spans, plan_slot_reads

SMALL_RING = 64 * KiB  # 8 slots of 8 KiB: far smaller than the largest tensors below


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> StandIn:
    """Sends this test's loads through the ring with the instrumented stand-in copy engine."""
    return StandIn(monkeypatch)


def cfg(**overrides: object) -> StreamerConfig:
    values: dict[str, object] = {"concurrency": 4, "block_size": 16 * KiB, "memory_limit": SMALL_RING}
    values.update(overrides)
    return StreamerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory: pytest.TempPathFactory) -> Written:
    """Every dtype at odd sizes, from 0 bytes to many slots (each slot is 8 KiB), in two shards."""
    g = torch.Generator().manual_seed(31)
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, dtype) in enumerate(TORCH_DTYPE.items()):
        tensors[f"{name}.big"] = random_tensor((37 * KiB + i,), dtype, g)
        tensors[f"{name}.small"] = random_tensor((3, 5 + i), dtype, g)
        tensors[f"{name}.scalar"] = random_tensor((), dtype, g)
    tensors["empty"] = torch.empty(0, 4)
    tensors["huge"] = random_tensor((96 * KiB,), torch.float32, g)  # 384 KiB: 6x the whole ring
    return write_checkpoint(tmp_path_factory.mktemp("dtypes"), tensors, shards=2)


# --- correctness --------------------------------------------------------------------------------


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_load_is_bit_exact_for_every_dtype_through_a_small_ring(
    standin: StandIn, every_dtype: Written, io_mode: str
) -> None:
    got = streamer.load(every_dtype.index, config=cfg(io_mode=io_mode))
    assert_same_dict(got, reference_load(every_dtype.shards))
    assert list(got) == checkpoint_order(every_dtype.shards)
    standin.assert_clean()
    engine = standin.engines[0]
    assert engine.scheduled == engine.finished > 0


@pytest.mark.parametrize("order", ["completion", "checkpoint"])
def test_streaming_order_slot_reuse_and_limit(standin: StandIn, every_dtype: Written, order: str) -> None:
    with streamer.open(every_dtype.index, config=cfg(), order=order) as s:
        names = []
        for name, tensor in s:
            assert_same(tensor, every_dtype.tensors[name], name)
            names.append(name)
        metrics = s.metrics
    assert sorted(names) == sorted(every_dtype.tensors)
    if order == "checkpoint":
        assert names == checkpoint_order(every_dtype.shards)
    assert metrics["peak_buffer_bytes"] <= SMALL_RING
    assert metrics["ring_stalls"] > 0, "the ring never filled up: backpressure was not exercised"
    assert metrics["copies"] == standin.engines[0].scheduled
    standin.assert_clean()


@pytest.mark.parametrize("concurrency", [2, 8])
def test_without_a_limit_the_ring_holds_two_rounds_of_reads(
    standin: StandIn, every_dtype: Written, concurrency: int
) -> None:
    """Every byte of the ring is first-touched or page-locked by the load, so by default it is only
    as large as two rounds of the readers' blocks (1 GiB cut a 4 GiB load_into 2.4x here)."""
    config = cfg(memory_limit=None, concurrency=concurrency)
    with streamer.open(every_dtype.index, config=config) as s:
        for name, tensor in s:
            assert_same(tensor, every_dtype.tensors[name], name)
        metrics = s.metrics
    assert metrics["peak_buffer_bytes"] == 2 * concurrency * config.block_size
    standin.assert_clean()


def test_without_a_limit_tiny_blocks_still_get_a_page_per_slot(
    standin: StandIn, every_dtype: Written
) -> None:
    config = cfg(memory_limit=None, concurrency=1, block_size=512)
    with streamer.open(every_dtype.index, config=config) as s:
        got = dict(iter(s))
        metrics = s.metrics
    assert_same_dict(got, every_dtype.tensors)
    assert metrics["peak_buffer_bytes"] == 8 * DIRECT_IO_ALIGNMENT
    standin.assert_clean()


def test_reads_in_flight_are_reader_blocks_locally_and_get_blocks_on_s3() -> None:
    config = StreamerConfig(concurrency=3, block_size=KiB << 10, s3=S3Config(concurrency=5))
    assert LocalStorage(config).reads_in_flight(config) == 3 << 20
    assert S3Storage(config.s3).reads_in_flight(config) == 5 << 20


def test_ring_larger_than_the_checkpoint_is_cut_to_size(standin: StandIn, every_dtype: Written) -> None:
    with streamer.open(every_dtype.index, config=cfg(memory_limit=None, block_size=8 << 20)) as s:
        assert len(dict(iter(s))) == len(every_dtype.tensors)
        metrics = s.metrics
    read_span = sum(os.path.getsize(p) for p in every_dtype.shards) + 2 * DIRECT_IO_ALIGNMENT
    assert metrics["peak_buffer_bytes"] <= read_span


def test_a_pinned_ring_is_pinned_once_per_handle_and_unpinned_before_it_is_unmapped(
    standin: StandIn, every_dtype: Written, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ring is memory streamer maps itself: page-aligned (O_DIRECT reads land in it), as large
    as the limit allows rather than a power of two, pinned once however many loads reuse it,
    and unpinned while still mapped."""
    events: list[tuple[str, int, int]] = []
    standin.options = {"pinned": True, "pins": events}
    free = native.free

    def logged_free(pointer: object, size: int, hugepages: bool) -> None:
        events.append(("free", int(native.ffi.cast("uintptr_t", pointer)), size))
        free(pointer, size, hugepages)

    monkeypatch.setattr(native, "free", logged_free)
    limit = 100 * KiB
    with streamer.open(every_dtype.index, config=cfg(memory_limit=limit)) as s:
        first = dict(iter(s))
        second = dict(iter(s))
    gc.collect()
    expected = reference_load(every_dtype.shards)
    assert_same_dict(first, expected)
    assert_same_dict(second, expected)
    pins = [event for event in events if event[0] == "pin"]
    assert len(pins) == 1, pins
    _, address, size = pins[0]
    assert address % os.sysconf("SC_PAGE_SIZE") == 0
    assert 64 * KiB < size <= limit
    assert [kind for kind, at, _ in events if at == address] == ["pin", "unpin", "free"]
    standin.assert_clean()


class _Cudart:
    """The two ``torch.cuda.cudart()`` calls pinning makes, logged; registering fails with ``error``."""

    def __init__(self, error: int, calls: list[tuple[object, ...]]) -> None:
        self.error = error
        self.calls = calls

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address, size, flags))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0


def test_the_cuda_engine_registers_the_ring_and_names_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CudaCopyEngine.pin`` without a GPU: the ring's own pages registered portable, unregistered
    at the same address, and a refusal a ``DeviceError`` naming the size, device and CUDA error."""
    engine = CudaCopyEngine.__new__(CudaCopyEngine)  # no stream: pinning does not use one
    engine._device = torch.device("cuda:1")
    memory = torch.empty(8192, dtype=torch.uint8)
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(0, calls))
    unpin = engine.pin(memory)
    assert calls == [("register", memory.data_ptr(), 8192, 1)]
    unpin()
    assert calls[-1] == ("unregister", memory.data_ptr())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _Cudart(2, calls))
    with pytest.raises(DeviceError, match=r"8192-byte host ring for cuda:1 \(cudaError 2\)"):
        engine.pin(memory)


def test_unaligned_tensors_are_copied_into_aligned_memory(standin: StandIn, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(32)
    entries, tensors = [], {}
    for i, dtype in enumerate(["F64", "I32", "BF16", "C64", "U8", "F32"]):
        entry, tensor = raw_entry(f"t{i}", dtype, (1000 + i,), generator=g)
        entries.append(entry)
        tensors[entry.name] = tensor
    path = tmp_path / "odd.safetensors"
    write_raw(path, entries, data_start_mod8=3)
    got = streamer.load_file(path, config=cfg())
    assert_same_dict(got, tensors)
    standin.assert_clean()


def test_get_tensor_reuses_the_handles_ring_and_works_during_an_iteration(
    standin: StandIn, every_dtype: Written
) -> None:
    with streamer.open(every_dtype.index, config=cfg()) as s:
        assert_same(s.get_tensor("huge"), every_dtype.tensors["huge"])
        assert s.metrics["ring_alloc_s"] > 0
        iterator = iter(s)
        first, tensor = next(iterator)  # holds the ring: get_tensor needs one of its own
        assert_same(tensor, every_dtype.tensors[first])
        assert_same(s.get_tensor("F16.big"), every_dtype.tensors["F16.big"])
        rest = dict(iterator)
        assert len(rest) == len(every_dtype.tensors) - 1
        assert_same(s.get_tensor("I8.small"), every_dtype.tensors["I8.small"])
        assert s.metrics["ring_alloc_s"] == 0.0  # the spare ring was reused
    standin.assert_clean()


# --- errors and clean-up ----------------------------------------------------------------------


def _leak_counts() -> tuple[int, int]:
    gc.collect()
    return thread_count(), fd_count()


@pytest.mark.parametrize("fail_at", [0, 7])
def test_a_failing_copy_stops_everything_with_a_named_error(
    standin: StandIn, every_dtype: Written, fail_at: int, deadline: object
) -> None:
    deadline(60)  # type: ignore[operator]
    before = _leak_counts()
    standin.options = {"fail_at": fail_at}
    with pytest.raises(DeviceError, match="injected copy failure") as info:
        streamer.load(every_dtype.index, config=cfg())
    assert info.value.tensor in every_dtype.tensors
    assert isinstance(info.value.__cause__, RuntimeError)
    assert _leak_counts() == before
    standin.assert_clean()  # closed, and no slot was refilled under the copies still running
    assert not standin.engines[0].busy


def test_a_truncated_file_stops_everything_with_a_read_error(
    standin: StandIn, tmp_path: Path, deadline: object
) -> None:
    deadline(60)  # type: ignore[operator]
    g = torch.Generator().manual_seed(33)
    tensors = {f"t{i}": random_tensor((16 * KiB,), torch.float32, g) for i in range(8)}
    written = write_checkpoint(tmp_path, tensors, index=False)
    path = written.shards[0]
    before = _leak_counts()
    with streamer.open(path, config=cfg()) as s:  # the header is checked here, while it is whole
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100 * KiB)
        with pytest.raises(ReadError, match="file ended early") as info:
            dict(iter(s))
    assert info.value.path == str(path)
    assert info.value.tensor in tensors
    assert _leak_counts() == before
    standin.assert_clean()


def test_early_exit_frees_the_ring_and_waits_for_copies(standin: StandIn, every_dtype: Written) -> None:
    standin.options = {"max_delay": 0.01}
    before = _leak_counts()
    with streamer.open(every_dtype.index, config=cfg()) as s:
        for _ in s:
            break  # dropping the pass ends it; the handle keeps the ring for its next read
        ring = s._rings._spare
        assert ring is not None
        ring_ref = weakref.ref(ring)
        del ring
    gc.collect()
    assert ring_ref() is None, "the ring outlived the handle's close()"
    assert _leak_counts() == before
    standin.assert_clean()
    assert all(not engine.busy for engine in standin.engines)


def test_memory_limit_below_one_page_is_refused(standin: StandIn, every_dtype: Written) -> None:
    with pytest.raises(ConfigError, match="memory_limit"):
        streamer.load(every_dtype.index, config=cfg(memory_limit=1000))


# --- load_into ----------------------------------------------------------------------------------


def _zeros_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in tensors.items()}


@pytest.mark.parametrize("through", ["thread-copy", "stand-in"])
def test_load_into_fills_existing_tensors_in_place(
    request: pytest.FixtureRequest, every_dtype: Written, through: str
) -> None:
    if through == "stand-in":
        request.getfixturevalue("standin")
    dest = _zeros_like(every_dtype.tensors)
    pointers = {name: t.data_ptr() for name, t in dest.items()}
    result = streamer.load_into(dest, every_dtype.index, config=cfg())
    assert result == streamer.IncompatibleKeys([], [])
    assert_same_dict(dest, every_dtype.tensors)
    assert {name: t.data_ptr() for name, t in dest.items()} == pointers


def test_load_into_parameters_and_non_contiguous_tensors(standin: StandIn, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(34)
    tensors = {
        "weight": random_tensor((64, 48), torch.float32, g),
        "bias": random_tensor((48,), torch.bfloat16, g),
        "table": random_tensor((40, 30), torch.int64, g),
    }
    written = write_checkpoint(tmp_path, tensors, index=False)
    module_weight = torch.nn.Parameter(torch.zeros(64, 48))
    transposed = torch.zeros(30, 40, dtype=torch.int64).t()  # non-contiguous (40, 30)
    dest = {"weight": module_weight, "bias": torch.zeros(48, dtype=torch.bfloat16), "table": transposed}
    streamer.load_into(dest, written.source, config=cfg())
    assert module_weight.requires_grad
    assert_same(module_weight.detach(), tensors["weight"])
    assert_same(dest["bias"], tensors["bias"])
    assert_same(transposed.contiguous(), tensors["table"])
    standin.assert_clean()


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ("dtype", ConfigError, "dtype mismatch"),
        ("shape", ConfigError, "shape mismatch"),
        ("extra", SourceError, "missing from the checkpoint"),
        ("missing", SourceError, "not in dest"),
        ("not-a-tensor", ConfigError, "not a tensor"),
    ],
)
def test_load_into_mismatches_name_the_tensor(
    every_dtype: Written, change: str, error: type[Exception], message: str
) -> None:
    dest = _zeros_like(every_dtype.tensors)
    name = "BF16.small"
    if change == "dtype":
        dest[name] = dest[name].float()
    elif change == "shape":
        dest[name] = dest[name].reshape(-1)
    elif change == "extra":
        name = "not.in.checkpoint"
        dest[name] = torch.zeros(3)
    elif change == "missing":
        name = next(iter(every_dtype.tensors))
        del dest[name]
    else:
        dest[name] = [1, 2, 3]  # type: ignore[assignment]
    with pytest.raises(error, match=message) as info:
        streamer.load_into(dest, every_dtype.index, config=cfg())
    assert info.value.tensor == name  # type: ignore[attr-defined]


def test_load_into_non_strict_loads_the_names_both_sides_have(every_dtype: Written) -> None:
    dest = _zeros_like(every_dtype.tensors)
    del dest["huge"]
    dest["extra"] = torch.full((4,), 7.0)
    result = streamer.load_into(dest, every_dtype.index, config=cfg(), strict=False)
    assert result.missing_keys == ["extra"] and result.unexpected_keys == ["huge"]
    assert torch.equal(dest["extra"], torch.full((4,), 7.0))
    assert_same_dict(
        {n: dest[n] for n in dest if n != "extra"},
        {n: t for n, t in every_dtype.tensors.items() if n != "huge"},
    )


# --- devices and CUDA initialisation --------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_device_error(every_dtype: Written) -> None:
    with pytest.raises(DeviceError, match="no usable CUDA device"):
        streamer.load(every_dtype.index, device="cuda:0")
    with pytest.raises(DeviceError, match="only 'cpu' and 'cuda"):
        streamer.load_into({"huge": torch.zeros(96 * KiB, device="meta")}, every_dtype.index, strict=False)


_NO_CUDA_CHILD = r"""
import sys
import torch

touched = []
for name in ("init", "_lazy_init", "current_device", "set_device", "Stream", "Event", "synchronize"):
    original = getattr(torch.cuda, name)
    def spy(*args, _name=name, _original=original, **kwargs):
        touched.append(_name)
        return _original(*args, **kwargs)
    setattr(torch.cuda, name, spy)

import streamer
streamer.load(sys.argv[1])
assert not torch.cuda.is_initialized(), "CUDA was initialised"
assert touched == [], f"streamer called torch.cuda.{touched}"
print("clean")
"""


def test_import_and_cpu_load_never_touch_cuda(every_dtype: Written) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _NO_CUDA_CHILD, str(every_dtype.index)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=every_dtype.directory,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("clean")


# --- planner ----------------------------------------------------------------------------------


@pytest.mark.parametrize("slot_size", [4096, 8192, 65536])
def test_pieces_cover_every_wanted_byte_once_at_aligned_offsets(slot_size: int) -> None:
    spans = [Span(0, 100, 5000), Span(0, 5008, 30001), Span(0, 200_000, 200_001), Span(1, 8, 70_000)]
    regions = group_spans(spans, max_gap=2 * DIRECT_IO_ALIGNMENT)
    assert regions == [Span(0, 100, 30001), Span(0, 200_000, 200_001), Span(1, 8, 70_000)]
    pieces = plan_slot_reads(regions, slot_size=slot_size, block_size=4096, alignment=DIRECT_IO_ALIGNMENT)
    covered: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for index, piece in enumerate(pieces):
        assert piece.read_begin % DIRECT_IO_ALIGNMENT == 0 and piece.read_end - piece.read_begin <= slot_size
        assert piece.read_begin <= piece.begin < piece.end <= piece.read_end
        credited = 0
        for block in piece.blocks:
            assert block.first_unit == block.last_unit == index
            assert (
                block.read_offset % DIRECT_IO_ALIGNMENT == 0
                and block.dst == block.read_offset - piece.read_begin
            )
            assert block.dst + block.read_length <= slot_size
            credited += block.acc_end - block.acc_begin
        assert credited == piece.end - piece.begin
        covered[piece.file].append((piece.begin, piece.end))
    for file, ranges in covered.items():
        wanted = [(r.begin, r.end) for r in regions if r.file == file]
        merged: list[tuple[int, int]] = []
        for begin, end in ranges:
            if merged and merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((begin, end))
        assert merged == wanted

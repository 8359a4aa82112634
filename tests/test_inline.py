"""Small runs of local files read on the caller's thread (``streamer.run.inline``): bit-exact as
the engine is, each tensor in memory of its own, no reader thread started, the same typed errors,
and the engine again wherever a run is larger, limited or asks for O_DIRECT."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import (
    TORCH_DTYPE,
    assert_same_dict,
    random_tensor,
    raw_entry,
    reference_load,
    thread_count,
    write_checkpoint,
    write_raw,
)

import streamer
from streamer import ReadError, StreamerConfig
from streamer.run import inline as inline_run


@pytest.fixture
def every_dtype(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    tensors = {f"{name}.{i}": random_tensor(shape, dtype, g) for name, dtype in TORCH_DTYPE.items()
               for i, shape in enumerate([(), (0, 3), (7,), (5, 33)])}  # fmt: skip
    return write_checkpoint(tmp_path, tensors, shards=2).directory


def test_a_small_run_is_bit_exact_for_every_dtype_and_starts_no_thread(every_dtype: Path) -> None:
    shards = sorted(every_dtype.glob("*.safetensors"))
    expected = reference_load(shards)
    before = thread_count()
    seen: list[int] = []
    with streamer.open(every_dtype) as handle:
        got = {}
        for name, tensor in handle:
            got[name] = tensor
            seen.append(threading.active_count())
        metrics = handle.metrics
    assert_same_dict(got, expected)
    assert thread_count() == before and max(seen) == threading.active_count()
    assert metrics["readers"] == 0 and metrics["bytes_read"] == metrics["bytes"] > 0
    assert_same_dict(streamer.load(every_dtype), expected)
    assert_same_dict(streamer.load_file(shards[0]), safetensors.torch.load_file(shards[0]))


def test_each_tensor_owns_its_memory(every_dtype: Path) -> None:
    loaded = streamer.load(every_dtype)
    for name, tensor in loaded.items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
    pointers = [t.data_ptr() for t in loaded.values() if t.numel()]
    assert len(set(pointers)) == len(pointers)


def test_unaligned_data_subsets_and_get_tensor(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(8)
    entries, tensors = [], {}
    for i, dtype in enumerate(["F64", "I32", "BF16", "C64", "U8", "F32", "BOOL"]):
        entry, tensor = raw_entry(f"t{i}", dtype, (100 + i, 3), generator=g)  # odd sizes: odd offsets
        entries.append(entry)
        tensors[entry.name] = tensor
    path = tmp_path / "odd.safetensors"
    write_raw(path, entries, data_start_mod8=3)
    assert_same_dict(streamer.load_file(path), tensors)
    with streamer.safe_open(path, "pt") as opened:
        for name in ("t3", "t0", "t6"):
            assert_same_dict({name: opened.get_tensor(name)}, {name: tensors[name]})
    dest = {name: torch.zeros_like(t) for name, t in tensors.items() if name in ("t1", "t4")}
    streamer.load_into(dest, path, strict=False)
    assert_same_dict(dest, {name: tensors[name] for name in dest})


@pytest.mark.parametrize("where", ["mid_tensor", "last_byte", "everything"])
def test_a_file_truncated_after_open_is_a_read_error_naming_file_and_tensor(
    tmp_path: Path, where: str
) -> None:
    g = torch.Generator().manual_seed(4)
    tensors = {f"w{i}": random_tensor((1000,), torch.float32, g) for i in range(8)}
    path = write_checkpoint(tmp_path, tensors, index=False).shards[0]
    size = path.stat().st_size
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with streamer.open(path) as handle:
        cut = {"mid_tensor": size - 6000, "last_byte": size - 1, "everything": 100}[where]
        os.truncate(path, cut)
        handed: list[str] = []
        with pytest.raises(ReadError, match="file ended early") as info:
            handed.extend(name for name, _ in handle)
    assert info.value.path == str(path) and handed == []
    assert info.value.offset == max(cut, data_start)  # where the file came up short
    assert info.value.tensor in tensors


def test_a_missing_or_unreadable_file_after_open_is_typed(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, {"a": torch.ones(3)}, index=False)
    with streamer.open(written.shards[0]) as handle:
        written.shards[0].unlink()
        with pytest.raises(streamer.SourceError, match="cannot open") as info:
            list(handle)
    assert info.value.path == str(written.shards[0])


def test_the_engine_reads_runs_that_are_larger_limited_or_direct(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, {f"w{i}": torch.ones(64 << 10) for i in range(4)}, index=False)
    source = written.shards[0]  # 1 MiB of tensors
    for config, inline in [
        (StreamerConfig(), True),
        (StreamerConfig(inline_max_bytes="512KiB"), False),
        (StreamerConfig(inline_max_bytes=0), False),
        (StreamerConfig(memory_limit="512KiB"), False),  # a streaming limit below the run
        (StreamerConfig(io_mode="direct"), False),
    ]:
        with streamer.open(source, config=config) as handle:
            for name, tensor in handle:  # each dropped: within any limit
                assert_same_dict({name: tensor}, {name: written.tensors[name]})
            assert (handle.metrics["readers"] == 0) == inline, config
    with streamer.open(source, config=StreamerConfig(memory_limit="512KiB")) as handle:
        assert handle.get_tensor("w1").sum() == 64 << 10  # one tensor fits the limit: inline
        assert handle.metrics["readers"] == 0


def test_inline_max_bytes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert StreamerConfig().inline_max_bytes == 8 << 20
    monkeypatch.setenv("STREAMER_INLINE_MAX_BYTES", "0")
    assert StreamerConfig().inline_max_bytes == 0
    monkeypatch.setenv("STREAMER_INLINE_MAX_BYTES", "4MiB")
    assert StreamerConfig().inline_max_bytes == 4 << 20


def test_a_run_read_in_two_halves_is_bit_exact_and_a_failure_in_either_half_is_raised(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(6)
    tensors = {f"w{i}": random_tensor((256 << 10,), torch.float32, g) for i in range(6)}  # 6 MiB
    path = write_checkpoint(tmp_path, tensors, index=False).shards[0]
    before = thread_count()
    assert_same_dict(streamer.load_file(path), tensors)
    assert thread_count() == before  # the helper was joined
    size = path.stat().st_size
    with streamer.open(path) as handle:
        os.truncate(path, size - (1 << 20))  # the second half's last tensor is cut
        with pytest.raises(ReadError, match="file ended early") as info:
            list(handle)
    assert info.value.tensor == "w5" and info.value.path == str(path)
    assert thread_count() == before


def test_the_caller_reads_on_while_the_helper_thread_is_held_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper kept off the CPU (torch's OpenMP workers spin on the other core after each parallel
    op) must not stall the load: the caller takes every other piece, then waits only for the one
    the helper holds."""
    g = torch.Generator().manual_seed(8)
    tensors = {f"w{i}": random_tensor((512 << 10,), torch.float32, g) for i in range(4)}  # 8 MiB
    path = write_checkpoint(tmp_path, tensors, index=False).shards[0]
    read = inline_run.Piece.read
    by_caller: list[inline_run.Piece] = []
    caller_done = threading.Event()
    pieces = (8 << 20) // inline_run.PIECE_MIN_BYTES

    def held_up_read(piece: inline_run.Piece) -> None:
        if threading.current_thread().name == "streamer-inline":
            assert caller_done.wait(30), "the caller waited for the helper before reading on"
        else:
            by_caller.append(piece)
            if len(by_caller) == pieces - 1:
                caller_done.set()
        read(piece)

    monkeypatch.setattr(inline_run.Piece, "read", held_up_read)
    assert_same_dict(streamer.load_file(path), tensors)
    assert len(by_caller) == pieces - 1

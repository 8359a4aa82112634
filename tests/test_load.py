"""Loading is bit-exact against ``safetensors`` for every dtype, layout, source kind and setting."""

from __future__ import annotations

import gc
import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import (
    TORCH_DTYPE,
    KiB,
    MiB,
    RawEntry,
    Written,
    assert_same,
    assert_same_dict,
    checkpoint_order,
    config,
    file_layout,
    mapping_of,
    needs_fill,
    needs_huge_pages,
    random_tensor,
    raw_bytes,
    raw_entry,
    reference_load,
    snapshot,
    takes_direct_io,
    write_checkpoint,
    write_raw,
)

import streamer
from streamer.format.dtypes import DTYPES
from streamer_bench.pagecache import evict_and_verify, resident_bytes

WRITABLE = sorted(name for name in DTYPES if name in safetensors.torch._TYPES)  # what save_file can write
# hand-built instead; F4 (two values per byte, header and torch shapes differ) has its own tests
# in test_format_differential.py
NOT_WRITABLE = sorted(name for name in DTYPES if name not in safetensors.torch._TYPES and name != "F4")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Written:
    """~3 MiB in 3 shards with an index: large tensors spanning many blocks, small ones sharing
    blocks, 0-d and zero-size tensors, several dtypes, odd byte counts."""
    g = torch.Generator().manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    dtypes = [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int8,
        torch.uint8,
        torch.float64,
        torch.int64,
        torch.bool,
        torch.float8_e4m3fn,
        torch.complex64,
        torch.int16,
    ]
    shapes = [
        (1000, 257),
        (311, 7),
        (),
        (0,),
        (3, 0, 5),
        (1,),
        (123457,),
        (64, 64),
        (5, 3, 2),
        (4099,),
        (2, 1, 1, 3),
        (70001,),
    ]
    for i in range(36):
        dtype = dtypes[i % len(dtypes)]
        shape = shapes[i % len(shapes)]
        tensors[f"layers.{i}.weight"] = random_tensor(shape, dtype, g)
    directory = tmp_path_factory.mktemp("mixed")
    return write_checkpoint(directory, tensors, shards=3, metadata={"format": "pt", "origin": "mixed"})


@pytest.fixture(scope="module")
def mixed_reference(mixed: Written) -> dict[str, torch.Tensor]:
    return reference_load(mixed.shards)


# --- every dtype ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", WRITABLE)
def test_every_dtype_bit_exact(tmp_path: Path, name: str) -> None:
    dtype = DTYPES[name].torch_dtype
    g = torch.Generator().manual_seed(len(name))
    tensors = {
        "scalar": random_tensor((), dtype, g),
        "vector": random_tensor((7,), dtype, g),
        "matrix": random_tensor((3, 5), dtype, g),
        "empty": random_tensor((0, 4), dtype, g),
        "cube": random_tensor((2, 3, 4), dtype, g),
        "long": random_tensor((10007,), dtype, g),  # spans several 4 KiB blocks
    }
    path = tmp_path / f"{name}.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    expected = safetensors.torch.load_file(str(path))
    assert_same_dict(expected, tensors)  # the reference itself round-trips
    for cfg in (config(block_size=4096, concurrency=3), config(block_size=8 * MiB, concurrency=1)):
        got = streamer.load_file(path, config=cfg)
        assert_same_dict(got, expected)
        assert list(got) == checkpoint_order([path])


@pytest.mark.parametrize("name", NOT_WRITABLE)
def test_dtype_safetensors_cannot_write_is_bit_exact(tmp_path: Path, name: str) -> None:
    """F8_E8M0: torch holds it, safetensors 0.8 cannot write it; built by hand and compared to torch."""
    g = torch.Generator().manual_seed(7)
    entries, expected = [], {}
    for tensor_name, shape in (("scalar", ()), ("vector", (9,)), ("empty", (0,)), ("matrix", (33, 65))):
        entry, tensor = raw_entry(tensor_name, name, shape, generator=g)
        entries.append(entry)
        expected[tensor_name] = tensor
    path = tmp_path / "hand.safetensors"
    write_raw(path, entries)
    got = streamer.load_file(path, config=config(block_size=4096))
    assert_same_dict(got, expected)


def test_random_bits_cover_special_values() -> None:
    """The generator really produces NaN payloads and infinities (so bit-exactness means something)."""
    t = random_tensor((1 << 16,), torch.float16, torch.Generator().manual_seed(0))
    assert torch.isnan(t).any() and torch.isinf(t).any()
    assert len({raw_bytes(x) for x in t[torch.isnan(t)][:200]}) > 1  # distinct NaN payloads


# --- shapes and counts ----------------------------------------------------------------------


def test_zero_dim_and_zero_size_tensors(tmp_path: Path) -> None:
    tensors = {
        "s_f32": torch.tensor(3.5),
        "s_bool": torch.tensor(True),
        "s_i64": torch.tensor(-(2**62)),
        "s_c64": torch.tensor(1 + 2j, dtype=torch.complex64),
        "e0": torch.empty(0),
        "e1": torch.empty((0, 3), dtype=torch.bfloat16),
        "e2": torch.empty((4, 0, 2), dtype=torch.int8),
        "e3": torch.empty((0,), dtype=torch.float8_e5m2),
    }
    path = tmp_path / "small.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    expected = safetensors.torch.load_file(str(path))
    for order in ("completion", "checkpoint"):
        with streamer.open(path, config=config(), order=order) as s:
            got = dict(iter(s))
        assert_same_dict(got, expected)
    assert streamer.load_file(path)["s_c64"].item() == 1 + 2j

    only_empty = {"a": torch.empty(0), "b": torch.empty((2, 0), dtype=torch.float16)}
    path = tmp_path / "only_empty.safetensors"
    safetensors.torch.save_file(only_empty, str(path))
    assert_same_dict(streamer.load_file(path), only_empty)
    with streamer.open(path) as s:
        assert_same(s.get_tensor("b"), only_empty["b"])


def test_file_without_tensors(tmp_path: Path) -> None:
    path = tmp_path / "none.safetensors"
    safetensors.torch.save_file({}, str(path), metadata={"k": "v"})
    assert streamer.load_file(path) == {}
    with streamer.open(path) as s:
        assert s.keys() == []
        assert s.metadata() == {"k": "v"}
        assert list(s) == []
        assert s.metrics["tensors"] == 0 and s.metrics["bytes"] == 0


@pytest.mark.parametrize(("concurrency", "block_size"), [(7, 4096), (2, 8 * MiB)])
def test_thousands_of_tiny_tensors(tmp_path: Path, concurrency: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.int64, torch.float8_e5m2]
    shapes = [(), (1,), (3,), (0,), (2, 3), (5,)]
    tensors = {f"t{i:04d}": random_tensor(shapes[i % 6], dtypes[(i // 6) % 6], g) for i in range(3000)}
    written = write_checkpoint(tmp_path, tensors, shards=2)
    expected = reference_load(written.shards)
    cfg = config(concurrency=concurrency, block_size=block_size)
    got = streamer.load(written.source, config=cfg)
    assert_same_dict(got, expected)
    assert list(got) == checkpoint_order(written.shards)
    with streamer.open(written.source, config=cfg) as s:
        names = [name for name, _ in s]
        metrics = s.metrics
    assert sorted(names) == sorted(tensors)
    assert metrics["tensors"] == 3000
    if block_size == 4096:  # tiny tensors share blocks: far fewer reads than tensors
        assert metrics["blocks"] < 3000


# --- sources --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["index", "directory", "list", "reversed_list", "pathlike", "single_file"])
def test_sources(mixed: Written, mixed_reference: dict[str, torch.Tensor], kind: str) -> None:
    shards = list(mixed.shards)
    source: Any = {
        "index": str(mixed.index),
        "directory": str(mixed.directory),
        "list": [str(p) for p in shards],
        "reversed_list": [str(p) for p in reversed(shards)],
        "pathlike": mixed.index,
        "single_file": shards[1],
    }[kind]
    expected = mixed_reference
    order = checkpoint_order(shards)
    if kind == "reversed_list":
        order = checkpoint_order(list(reversed(shards)))
    if kind == "single_file":
        expected = safetensors.torch.load_file(str(shards[1]))
        order = checkpoint_order([shards[1]])
    got = streamer.load(source, config=config())
    assert_same_dict(got, expected)
    assert list(got) == order
    with streamer.open(source, config=config(), order="checkpoint") as s:
        assert s.keys() == order
        assert len(s) == len(order)
        assert [n for n, _ in s] == order


def test_index_reads_only_the_shards_it_references(tmp_path: Path) -> None:
    """A directory may hold stale shards; an index, named or found in the directory, loads exactly
    what its weight_map names."""
    written = write_checkpoint(tmp_path, {"a": torch.arange(10.0), "b": torch.ones(3)}, shards=2)
    safetensors.torch.save_file({"stale": torch.zeros(5)}, str(tmp_path / "old.safetensors"))
    got = streamer.load(written.index, config=config())
    assert set(got) == {"a", "b"}
    with streamer.open(written.index) as s:
        assert set(s.files) == {str(p) for p in written.shards}
    assert set(streamer.load(tmp_path, config=config())) == {"a", "b"}  # a directory's index too


# --- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("concurrency", "block_size", "io_mode"),
    list(itertools.product([1, 2, 7, 16], [4096, 12345, MiB], ["buffered", "direct", "auto"])),
)
def test_settings_matrix(
    mixed: Written,
    mixed_reference: dict[str, torch.Tensor],
    tmp_path: Path,
    concurrency: int,
    block_size: int,
    io_mode: str,
) -> None:
    cfg = config(concurrency=concurrency, block_size=block_size, io_mode=io_mode)
    with streamer.open(mixed.index, config=cfg) as s:
        got = dict(iter(s))
        metrics = s.metrics
    assert_same_dict(got, mixed_reference)
    assert metrics["files"] == 3
    assert metrics["direct_files"] + metrics["buffered_files"] == 3
    if io_mode == "buffered" or block_size % 4096:  # O_DIRECT needs aligned blocks: buffered then
        assert metrics["direct_files"] == 0
    elif io_mode == "direct" and takes_direct_io(tmp_path):
        assert metrics["direct_files"] == 3
    elif io_mode == "auto":
        assert metrics["direct_files"] == 0  # just written and read: in the page cache


@pytest.mark.parametrize("limit", [4096, 100 * KiB, 1 * MiB])
@pytest.mark.parametrize("order", ["completion", "checkpoint"])
def test_streaming_under_a_memory_limit_is_bit_exact(
    mixed: Written, mixed_reference: dict[str, torch.Tensor], limit: int, order: str
) -> None:
    cfg = config(concurrency=4, block_size=4096, memory_limit=limit)
    got: dict[str, bytes] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # limits below the largest tensor warn
        with streamer.open(mixed.index, config=cfg, order=order) as s:
            names = []
            for name, tensor in s:
                assert_same(tensor, mixed_reference[name], name)
                names.append(name)
                got[name] = raw_bytes(tensor)
    assert sorted(names) == sorted(mixed_reference)
    if order == "checkpoint":
        assert names == checkpoint_order(mixed.shards)


def test_auto_mode_reads_uncached_files_direct(tmp_path: Path) -> None:
    tensors = {f"w{i}": random_tensor((256 * KiB,), torch.uint8) for i in range(4)}
    written = write_checkpoint(tmp_path, tensors, shards=2)
    if not takes_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    left = evict_and_verify(written.shards)
    if left:
        pytest.skip(f"the kernel kept {left} bytes cached after POSIX_FADV_DONTNEED")
    unfilled = config(io_mode="auto", block_size=64 * KiB, page_fill=False)  # fresh pages faulted in
    with streamer.open(written.index, config=unfilled) as s:
        got = dict(iter(s))
        metrics = s.metrics
    assert_same_dict(got, tensors)
    assert metrics["direct_files"] == 2, metrics
    assert metrics["prefault_bytes"] >= sum(t.nbytes for t in tensors.values()), metrics  # ahead of the reads
    for shard in written.shards:  # O_DIRECT left the cache empty; a buffered read fills it
        shard.read_bytes()
    with streamer.open(written.index, config=unfilled) as s:
        assert_same_dict(dict(iter(s)), tensors)
        assert s.metrics["buffered_files"] == 2, "cached files should be read buffered"


@needs_fill
@needs_huge_pages  # for the readers' buffers, without which O_DIRECT reads are not filled
def test_auto_mode_reads_cold_files_direct_into_page_filled_cpu_buffers(tmp_path: Path) -> None:
    """Cold files are read with O_DIRECT, warm ones buffered, both into CPU buffers through the
    page fill: a cold read through the page cache would cost a page-cache page and a copy more for
    every 4 KiB. No page of those buffers is faulted in, by a reader or ahead of it."""
    tensors = {f"w{i}": random_tensor((256 * KiB,), torch.uint8) for i in range(4)}
    written = write_checkpoint(tmp_path, tensors, shards=2)
    if not takes_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    left = evict_and_verify(written.shards)
    if left:
        pytest.skip(f"the kernel kept {left} bytes cached after POSIX_FADV_DONTNEED")
    filled = config(io_mode="auto", block_size=64 * KiB, page_fill=True)
    with streamer.open(written.index, config=filled) as s:
        assert_same_dict(dict(iter(s)), tensors)
        metrics = s.metrics
    assert metrics["direct_files"] == 2 and metrics["buffered_files"] == 0, metrics
    assert metrics["filled_bytes"] >= sum(t.nbytes for t in tensors.values()), metrics
    assert metrics["prefault_bytes"] == 0, metrics
    for shard in written.shards:
        shard.read_bytes()  # cached now: read buffered, through the page fill
    with streamer.open(written.index, config=filled) as s:
        assert_same_dict(dict(iter(s)), tensors)
        metrics = s.metrics
    assert metrics["buffered_files"] == 2 and metrics["prefault_bytes"] == 0, metrics


def test_auto_mode_decides_from_the_bytes_a_read_needs(tmp_path: Path) -> None:
    """``get_tensor`` of a cached tensor reads buffered, of an evicted one direct, in one file."""
    tensors = {f"w{i}": random_tensor((MiB,), torch.uint8) for i in range(4)}
    written = write_checkpoint(tmp_path, tensors, shards=1)
    if not takes_direct_io(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    (shard,) = written.shards
    shard.read_bytes()  # all of it cached
    (last_begin,) = [begin for name, begin, _ in file_layout(shard) if name == "w3"]
    fd = os.open(shard, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not evicted
        os.posix_fadvise(fd, last_begin, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if resident_bytes(shard) > last_begin + 4096:  # the page holding w3's start may stay
        pytest.skip("the kernel kept the evicted tail cached")
    with streamer.open(shard, config=config(io_mode="auto", block_size=64 * KiB, page_fill=False)) as s:
        assert_same(s.get_tensor("w0"), tensors["w0"], "w0")
        assert s.metrics["buffered_files"] == 1, "w0's pages are cached: buffered"
        assert_same(s.get_tensor("w3"), tensors["w3"], "w3")
        assert s.metrics["direct_files"] == 1, "w3's pages were evicted: O_DIRECT"


# --- order ----------------------------------------------------------------------------------


def test_checkpoint_order_is_file_then_offset_order(mixed: Written) -> None:
    expected = checkpoint_order(mixed.shards)
    # safetensors does not write tensors in insertion order, so this order is not a trivial one.
    assert expected != list(mixed.tensors)
    for concurrency in (1, 16):
        with streamer.open(
            mixed.index, config=config(concurrency=concurrency, block_size=4096), order="checkpoint"
        ) as s:
            assert s.keys() == expected
            assert [name for name, _ in s] == expected


def test_completion_order_yields_every_tensor_once(mixed: Written) -> None:
    with streamer.open(mixed.index, config=config(concurrency=16, block_size=4096)) as s:
        names = [name for name, _ in s]
    assert len(names) == len(set(names)) == len(mixed.tensors)
    assert set(names) == set(mixed.tensors)


# --- the handle -----------------------------------------------------------------------------


def test_keys_contains_len_files(mixed: Written) -> None:
    with streamer.open(mixed.index) as s:
        assert s.keys() == checkpoint_order(mixed.shards)
        assert len(s) == len(mixed.tensors)
        assert "layers.0.weight" in s and "nope" not in s
        assert s.files == tuple(str(p) for p in mixed.shards)
        assert s.metrics == {}  # nothing read yet


def test_metadata(tmp_path: Path, mixed: Written) -> None:
    with streamer.open(mixed.index) as s:
        assert s.metadata() == {"format": "pt", "origin": "mixed"}
    # Shards with different metadata: merged in file order, the first file wins a clash.
    safetensors.torch.save_file(
        {"a": torch.ones(2)}, str(tmp_path / "1.safetensors"), metadata={"shared": "first", "only1": "x"}
    )
    safetensors.torch.save_file(
        {"b": torch.ones(2)}, str(tmp_path / "2.safetensors"), metadata={"shared": "second", "only2": "y"}
    )
    safetensors.torch.save_file({"c": torch.ones(2)}, str(tmp_path / "3.safetensors"))
    with streamer.open(tmp_path) as s:
        assert s.metadata() == {"shared": "first", "only1": "x", "only2": "y"}
    with streamer.open([tmp_path / "2.safetensors", tmp_path / "1.safetensors"]) as s:
        assert s.metadata()["shared"] == "second"
    with streamer.open(tmp_path / "3.safetensors") as s:
        assert s.metadata() == {}


def test_get_tensor(mixed: Written, mixed_reference: dict[str, torch.Tensor]) -> None:
    with streamer.open(mixed.index, config=config(concurrency=7, block_size=4096)) as s:
        for name in s.keys():  # noqa: SIM118 (iterating a Streamer reads tensors)
            assert_same(s.get_tensor(name), mixed_reference[name], name)
        first = s.get_tensor("layers.0.weight")
        again = s.get_tensor("layers.0.weight")
        assert first.data_ptr() != again.data_ptr()  # each call returns memory of its own
        assert_same(first, again)
        assert s.metrics["tensors"] == 1
        # get_tensor between iterations and after one
        assert_same_dict(dict(iter(s)), mixed_reference)
        assert_same(s.get_tensor("layers.6.weight"), mixed_reference["layers.6.weight"])
    with pytest.raises(streamer.SourceError) as info:
        streamer.open(mixed.index).get_tensor("missing.weight")
    assert info.value.tensor == "missing.weight"


def test_indexing_and_dict_of_a_handle(mixed: Written, mixed_reference: dict[str, torch.Tensor]) -> None:
    with streamer.open(mixed.index, config=config()) as s:
        assert_same(s["layers.0.weight"], mixed_reference["layers.0.weight"])
        assert_same_dict(dict(s), mixed_reference)  # keys() + __getitem__, like a Mapping


def test_get_tensor_matches_safe_open(mixed: Written) -> None:
    from safetensors import safe_open

    shard = mixed.shards[0]
    with safe_open(str(shard), framework="pt") as ref, streamer.open(shard) as s:
        assert sorted(ref.keys()) == sorted(s.keys())
        assert (ref.metadata() or {}) == s.metadata()
        for name in ref.keys():  # noqa: SIM118 (safe_open is not iterable)
            assert_same(s.get_tensor(name), ref.get_tensor(name), name)


def test_iterating_twice_reads_again(mixed: Written, mixed_reference: dict[str, torch.Tensor]) -> None:
    with streamer.open(mixed.index, config=config()) as s:
        first = dict(iter(s))
        second = dict(iter(s))
    assert_same_dict(first, mixed_reference)
    assert_same_dict(second, mixed_reference)
    for name, t in first.items():
        if t.numel():
            assert t.data_ptr() != second[name].data_ptr()


def test_load_file_is_a_drop_in(mixed: Written) -> None:
    shard = mixed.shards[0]
    expected = safetensors.torch.load_file(str(shard))
    for call in (
        lambda: streamer.load_file(str(shard)),
        lambda: streamer.load_file(shard),
        lambda: streamer.load_file(str(shard), device="cpu"),
        lambda: streamer.load_file(str(shard), "cpu"),
        lambda: streamer.load_file(str(shard), device=torch.device("cpu")),
    ):
        got = call()
        assert type(got) is dict
        assert_same_dict(got, expected)
        assert all(t.device == torch.device("cpu") for t in got.values())
    # Loaded tensors behave like ordinary ones: writable in place, usable in ops.
    got = streamer.load_file(shard)
    for name, t in got.items():
        if t.dtype in (torch.float32, torch.float64, torch.int64) and t.numel() > 1:
            assert_same(t.add_(1), expected[name] + 1, name)


def test_env_defaults_are_used(
    mixed: Written, mixed_reference: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMER_CONCURRENCY", "3")
    monkeypatch.setenv("STREAMER_BLOCK_SIZE", "12KiB")
    monkeypatch.setenv("STREAMER_IO_MODE", "buffered")
    monkeypatch.setenv("STREAMER_INLINE_MAX_BYTES", "0")
    with streamer.open(mixed.index) as s:
        assert (s.config.concurrency, s.config.block_size, s.config.io_mode) == (3, 12 * KiB, "buffered")
        assert_same_dict(dict(iter(s)), mixed_reference)
        assert s.metrics["buffered_files"] == 3


# --- metrics --------------------------------------------------------------------------------


def test_metrics(mixed: Written) -> None:
    total = mixed.nbytes
    with streamer.open(mixed.index, config=config(block_size=4096)) as s:
        for _ in s:
            pass
        m = s.metrics
    assert m["bytes"] == total
    assert m["tensors"] == len(mixed.tensors)
    assert m["files"] == 3
    assert m["seconds"] > 0
    assert m["gb_per_s"] > 0
    assert abs(m["gb_per_s"] - total / m["seconds"] / 1e9) < 1e-6 * max(1.0, m["gb_per_s"])
    assert 0 <= m["time_to_first_tensor_s"] <= m["seconds"]
    assert m["bytes_read"] >= total  # aligned reads may include padding, never less
    assert m["blocks"] >= total // 4096
    for key in ("consumer_wait_s", "memory_wait_s", "alloc_s", "read_s", "worker_idle_s"):
        assert m[key] >= 0, key
    assert m["memory_wait_s"] <= m["consumer_wait_s"]
    assert m["peak_buffer_bytes"] >= total
    json.dumps(m)  # plain, JSON-friendly values

    with streamer.open(mixed.shards[0]) as s:
        name = s.keys()[0]
        tensor = s.get_tensor(name)
        m = s.metrics
    assert m["tensors"] == 1 and m["bytes"] == tensor.numel() * tensor.element_size()


# --- layouts safetensors never writes --------------------------------------------------------


@pytest.mark.parametrize("data_start_mod8", [None, 0, 3])
def test_tensor_offsets_not_aligned_to_the_dtype(tmp_path: Path, data_start_mod8: int | None) -> None:
    """A 3-byte U8 tensor, then wider dtypes at offsets that are not multiples of their size."""
    g = torch.Generator().manual_seed(5)
    specs = [
        ("u8", "U8", (3,)),
        ("f32", "F32", (5, 7)),
        ("bool", "BOOL", (1,)),
        ("f64", "F64", (9,)),
        ("i16", "I16", (3,)),
        ("c64", "C64", (2, 2)),
        ("bf16", "BF16", (11,)),
        ("big", "F32", (40000,)),
        ("f64_0d", "F64", ()),
    ]
    entries, expected = [], {}
    for name, dtype, shape in specs:
        entry, tensor = raw_entry(name, dtype, shape, generator=g)
        entries.append(entry)
        expected[name] = tensor
    path = tmp_path / "unaligned.safetensors"
    layout = write_raw(path, entries, data_start_mod8=data_start_mod8)
    dtype_of = {name: dtype for name, dtype, _ in specs}
    misaligned = [n for n, (begin, _) in layout.items() if begin % TORCH_DTYPE[dtype_of[n]].itemsize]
    assert len(misaligned) >= 3, layout  # the case under test really happens
    if data_start_mod8 is not None:
        assert "f32" in misaligned  # right after the 3-byte U8 tensor
    for cfg in (
        config(block_size=4096, concurrency=3),
        config(block_size=12345, concurrency=1),
        config(block_size=4096, memory_limit=8192),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # 8 KiB is below the largest tensor
            got = streamer.load_file(path, config=cfg)
            with streamer.open(path, config=cfg) as s:
                streamed = {name: t for name, t in s}
        assert_same_dict(got, expected)
        assert_same_dict(streamed, expected)
        for t in got.values():
            assert t.data_ptr() % t.element_size() == 0
            assert t.is_contiguous()


def test_padding_between_tensors_is_refused(tmp_path: Path) -> None:
    """Holes in the data section: safetensors refuses such a file (a length prefix off by one
    looks like this and would shift every tensor), and so do we, naming the tensor after the hole."""
    g = torch.Generator().manual_seed(9)
    entries = [
        raw_entry(name, dtype, shape, gap=gap, generator=g)[0]
        for name, dtype, shape, gap in [
            ("a", "F32", (100,), 0),
            ("b", "I64", (3,), 13),
            ("c", "U8", (9000,), 8192),
            ("d", "F16", (4,), 1),
        ]
    ]
    path = tmp_path / "holes.safetensors"
    write_raw(path, entries, data_start_mod8=5)
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error type
        safetensors.torch.load_file(path)
    with pytest.raises(streamer.HeaderError, match="leaves 13 bytes unclaimed after 'a'") as info:
        streamer.load_file(path, config=config(block_size=4096))
    assert (info.value.path, info.value.tensor) == (str(path), "b")


# --- ownership ------------------------------------------------------------------------------


def test_yielded_tensors_never_change(mixed: Written, mixed_reference: dict[str, torch.Tensor]) -> None:
    """Hold the first tensors while the rest stream through a small budget (buffers get freed and
    new ones allocated); what was handed out must stay as it was."""
    cfg = config(concurrency=4, block_size=4096, memory_limit=256 * KiB)
    held: dict[str, torch.Tensor] = {}
    at_delivery: dict[str, bytes] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with streamer.open(mixed.index, config=cfg) as s:
            for i, (name, tensor) in enumerate(s):
                if i < 8:
                    held[name] = tensor
                    at_delivery[name] = raw_bytes(tensor)
            # And once more through get_tensor and a second iteration, which allocate again.
            for name in list(s.keys())[:5]:
                s.get_tensor(name)
            for _ in s:
                pass
    gc.collect()
    assert len(held) == 8
    assert snapshot(held) == at_delivery
    for name, tensor in held.items():
        assert_same(tensor, mixed_reference[name], name)


def test_tensors_do_not_share_memory(mixed: Written) -> None:
    """Each tensor's bytes are its own: writing one never shows up in another."""
    got = streamer.load(mixed.index, config=config(block_size=4096))
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n) for n, t in got.items() if t.numel()
    )
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        assert end <= begin, f"{a} and {b} overlap"
    before = snapshot(got)
    victim = max(got, key=lambda n: got[n].numel() * got[n].element_size())
    got[victim].reshape(-1).view(torch.uint8).bitwise_not_()
    after = snapshot(got)
    assert [n for n in got if before[n] != after[n]] == [victim]


@pytest.mark.parametrize("limit", ["unlimited", 256 * KiB])
def test_each_tensor_has_a_storage_of_its_own_bytes(mixed: Written, tmp_path: Path, limit: int | str) -> None:
    """As safetensors' tensors: torch.save of one tensor writes that tensor, not the buffer it was
    read into beside its neighbours (a whole file, unlimited)."""
    got = streamer.load(mixed.index, config=config(memory_limit=limit, block_size=4096))
    for name, t in got.items():
        if t.numel():
            storage = t.untyped_storage()
            assert (storage.data_ptr(), storage.nbytes()) == (t.data_ptr(), t.nbytes), name
    name = min((n for n in got if got[n].nbytes >= 4096), key=lambda n: got[n].nbytes)
    saved = tmp_path / "one.pt"
    torch.save(got[name], saved)
    assert saved.stat().st_size < got[name].nbytes + 4096
    assert_same(torch.load(saved), got[name], name)


def test_memory_is_owned_not_a_file_mapping(tmp_path: Path) -> None:
    tensors = {"w": random_tensor((300 * KiB,), torch.uint8), "v": random_tensor((1000,), torch.float32)}
    written = write_checkpoint(tmp_path, tensors, index=False)
    path = written.shards[0]
    expected = snapshot(tensors)
    got = streamer.load_file(path, config=config(block_size=4096))
    for name, t in got.items():
        line = mapping_of(t.data_ptr())
        assert line is not None
        fields = line.split(maxsplit=5)
        backing = fields[5] if len(fields) > 5 else ""
        assert not backing.startswith("/"), f"{name} lives in a file mapping: {line}"
    # Overwrite the file in place, then shrink and delete it: the tensors do not notice.
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * size)
        f.flush()
        os.fsync(f.fileno())
    assert snapshot(got) == expected
    os.truncate(path, 0)
    path.unlink()
    assert snapshot(got) == expected


def test_loaded_tensors_are_writable_and_survive_the_handle(
    mixed: Written, mixed_reference: dict[str, torch.Tensor]
) -> None:
    with streamer.open(mixed.index, config=config()) as s:
        got = dict(iter(s))
    del s
    gc.collect()
    assert_same_dict(got, mixed_reference)
    for name, t in got.items():  # writable in place, like any tensor the process owns
        if t.numel() and t.dtype == torch.uint8:
            t.zero_()
            assert int(t.count_nonzero()) == 0, name


def test_raw_entry_helper_lays_bytes_where_the_header_says(tmp_path: Path) -> None:
    """Self-check of the hand-built files: safetensors itself reads them the same."""
    entries = [RawEntry("a", "U8", (3,), b"\x01\x02\x03"), RawEntry("b", "F32", (1,), b"\x00\x00\x80\x3f")]
    path = tmp_path / "raw.safetensors"
    layout = write_raw(path, entries, data_start_mod8=0)
    assert [n for n, _, _ in file_layout(path)] == ["a", "b"]
    assert layout["b"][0] % 4 != 0
    ref = safetensors.torch.load_file(str(path))
    assert ref["b"].item() == 1.0
    assert_same_dict(streamer.load_file(path), ref)


def test_source_files_lists_files_that_do_not_make_one_checkpoint(tmp_path: Path) -> None:
    """Each tensor-parallel rank's own files (vLLM's ``sharded_state``) hold the same names: not
    one checkpoint, yet a loader must learn which files are there to pick its own."""
    for rank in (0, 1):
        tensors = {"w": torch.full((4,), float(rank)), "b": torch.zeros(2)}
        safetensors.torch.save_file(tensors, str(tmp_path / f"model-rank-{rank}-part-0.safetensors"))
    with pytest.raises(streamer.SourceError, match="also defined"):
        streamer.open(tmp_path)
    files = streamer.api.source_files(tmp_path)
    assert files == [str(tmp_path / f"model-rank-{rank}-part-0.safetensors") for rank in (0, 1)]
    with pytest.raises(streamer.MissingFileError):
        streamer.api.source_files(tmp_path / "absent")

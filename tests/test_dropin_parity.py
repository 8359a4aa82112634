"""``streamer.safe_open`` / ``streamer.load_file`` against ``safetensors``: the same calls on the same
files, compared bit for bit, and exception for exception.

Where the two differ on purpose (an error type safetensors does not export, ``F4`` slices that
safetensors cannot make), the test states the difference; the README's table lists them all.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from conftest import (
    TORCH_DTYPE,
    KiB,
    MiB,
    RawEntry,
    assert_same,
    assert_same_dict,
    config,
    loopback_s3_config,
    random_tensor,
    raw_bytes,
    raw_entry,
    s3_client,
    write_raw,
)
from copy_standin import StandIn
from hypothesis import given, settings
from hypothesis import strategies as st

import streamer
from streamer import (
    ConfigError,
    FileClosedError,
    MissingFileError,
    MissingTensorError,
    PackedSliceError,
    SourceError,
    StreamerConfig,
)

SHAPE = (4, 6, 8)  # 192 elements: every dtype's bytes are a multiple of 8, so offsets stay aligned

# Indices on the first, middle and last dims: ranges, steps, negatives, ints, empties, ``...``, None.
INDICES: list[Any] = [
    slice(1, 3),
    slice(None, None, 2),
    slice(-3, -1),
    slice(3, 1),
    slice(10, 20),
    1,
    -1,
    (1, 2),
    (0, 0, 0),
    (),
    Ellipsis,
    (None,),
    (slice(None), slice(2, 5)),
    (slice(None), slice(1, 6, 2)),
    (slice(None), -2),
    (slice(None), slice(-4, None), None),
    (Ellipsis, slice(2, 6)),
    (Ellipsis, slice(1, 8, 3)),
    (Ellipsis, -1),
    (1, Ellipsis, 2),
    (slice(1, 3), slice(2, 4), slice(4, 8)),
    (slice(0, 1), slice(None), slice(0, 0)),
    (Ellipsis, Ellipsis),
]
# What torch refuses; safetensors refuses it the same way, so must we.
BAD_INDICES: list[Any] = [
    5,
    -5,
    (slice(None), 6),
    (slice(None),) * 4,
    slice(None, None, -1),
    slice(None, None, 0),
    1.0,
    "a",
]
ADVANCED_INDICES: list[Any] = [[0, 2], (slice(None), [1, 3]), torch.tensor(1), True]


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:  # the comparison is the point: any type
        return "error", exc


def assert_same_outcome(ours: Callable[[], Any], theirs: Callable[[], Any], what: str) -> None:
    """The same tensor (bits, dtype, shape), or an exception of the same type and message."""
    got, expected = _outcome(ours), _outcome(theirs)
    assert got[0] == expected[0], f"{what}: streamer {got[1]!r}, safetensors {expected[1]!r}"
    if got[0] == "ok":
        # Compacted first: a view with a size-1 dim may carry any stride there (torch's view of
        # ``t[None, 0, 0, 0]`` does), which the bytes helper cannot view.
        dense = torch.contiguous_format
        assert_same(got[1].clone(memory_format=dense), expected[1].clone(memory_format=dense), what)
    else:
        assert type(got[1]) is type(expected[1]), f"{what}: {type(got[1])} != {type(expected[1])}"
        assert str(got[1]) == str(expected[1]), what


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tensor of every dtype safetensors loads into torch (F4 apart), plus an F4 one."""
    g = torch.Generator().manual_seed(13)
    entries = [raw_entry(name, name, SHAPE, generator=g)[0] for name in TORCH_DTYPE]
    entries.append(RawEntry("F4", "F4", SHAPE, raw_bytes(random_tensor((96,), torch.uint8, g))))
    path = tmp_path_factory.mktemp("dropin") / "every_dtype.safetensors"
    write_raw(path, entries, metadata={"format": "pt"}, data_start_mod8=0)
    return path


@pytest.fixture
def opened(every_dtype: Path) -> Iterator[tuple[streamer.safe_open, Any]]:
    ours = streamer.safe_open(every_dtype, framework="pt", config=config())
    with safetensors.safe_open(str(every_dtype), framework="pt") as theirs:
        yield ours, theirs
    ours.close()


# --- the handle -------------------------------------------------------------------------------


def test_keys_metadata_and_tensors_match(opened: tuple[streamer.safe_open, Any]) -> None:
    ours, theirs = opened
    assert ours.keys() == theirs.keys()
    assert ours.offset_keys() == theirs.offset_keys()
    assert ours.metadata() == theirs.metadata() == {"format": "pt"}
    names = theirs.keys()  # a safetensors handle is not iterable
    for name in names:
        assert_same_outcome(lambda n=name: ours.get_tensor(n), lambda n=name: theirs.get_tensor(n), name)
    assert_same_dict(ours.get_tensors(), theirs.get_tensors())


def test_keys_are_sorted_and_metadata_none_without_any(tmp_path: Path) -> None:
    tensors = {"b.weight": torch.ones(2), "a.z": torch.zeros(3), "B": torch.ones(1), "a.b": torch.ones(4)}
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    with streamer.safe_open(path) as ours, safetensors.safe_open(str(path), "pt") as theirs:
        assert ours.keys() == theirs.keys() == sorted(tensors)
        assert ours.offset_keys() == theirs.offset_keys()
        assert ours.metadata() is None and theirs.metadata() is None
    safetensors.torch.save_file(tensors, str(path), metadata={})  # an empty ``__metadata__`` object
    with streamer.safe_open(path) as ours, safetensors.safe_open(str(path), "pt") as theirs:
        assert ours.metadata() == theirs.metadata() == {}
    # ``"__metadata__": null``: none, for both
    text = b'{"__metadata__": null, "t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}'
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"ab")
    with streamer.safe_open(path) as ours, safetensors.safe_open(str(path), "pt") as theirs:
        assert ours.metadata() is None and theirs.metadata() is None
        assert_same(ours.get_tensor("t"), theirs.get_tensor("t"))


def test_missing_file_is_a_file_not_found_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError):
        safetensors.safe_open(str(missing), "pt")
    for call in (
        lambda: streamer.safe_open(missing),
        lambda: streamer.load_file(missing),
        lambda: streamer.load_file(str(missing)),
    ):
        with pytest.raises(MissingFileError) as info:
            call()
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, SourceError)
        assert str(missing) in str(info.value)


def test_missing_tensor_is_a_key_error_naming_file_and_tensor(
    opened: tuple[streamer.safe_open, Any], every_dtype: Path
) -> None:
    ours, theirs = opened
    with pytest.raises(safetensors.SafetensorError):  # safetensors' own type, which it alone exports
        theirs.get_tensor("nope")
    for call in (ours.get_tensor, ours.get_slice):
        with pytest.raises(MissingTensorError) as info:
            call("nope")
        assert isinstance(info.value, KeyError) and isinstance(info.value, SourceError)
        message = str(info.value)
        assert message == f"no tensor of that name (file {str(every_dtype)!r}, tensor 'nope')"
    with streamer.open(every_dtype) as handle, pytest.raises(KeyError, match="nope"):
        handle.get_tensor("nope")


def test_closed_handle_refuses_reads_but_slices_taken_before_work(every_dtype: Path) -> None:
    ours = streamer.safe_open(every_dtype)
    theirs = safetensors.safe_open(str(every_dtype), "pt")
    slices = ours.get_slice("F32"), theirs.get_slice("F32")
    with ours, theirs:
        pass
    for handle in (ours, theirs):
        for call in (handle.keys, handle.metadata, lambda h=handle: h.get_tensor("F32")):
            with pytest.raises(Exception, match=r"(?i)file is closed"):
                call()
    with pytest.raises(FileClosedError, match=re.escape(str(every_dtype))):
        ours.get_slice("F32")
    assert isinstance(FileClosedError("x"), ValueError)
    assert_same(slices[0][1:3, :, 2], slices[1][1:3, :, 2])
    ours.close()  # twice is fine, as leaving ``with`` twice is for safetensors


@pytest.mark.parametrize("framework", ["np", "numpy", "tf", "flax", "mlx", "bogus", "PT"])
def test_frameworks_other_than_torch_are_a_config_error(every_dtype: Path, framework: str) -> None:
    with pytest.raises(ConfigError, match=repr(framework)):
        streamer.safe_open(every_dtype, framework)


def test_framework_device_and_backend_forms(every_dtype: Path) -> None:
    expected = safetensors.torch.load_file(str(every_dtype))
    for framework in ("pt", "torch"):
        for device in ("cpu", torch.device("cpu"), "cpu:0"):
            with streamer.safe_open(every_dtype, framework, device, backend="pread") as ours:
                assert_same(ours.get_tensor("BF16"), expected["BF16"])
    with pytest.raises(ConfigError, match="backend 'bogus'"):
        streamer.safe_open(every_dtype, "pt", backend="bogus")
    with pytest.raises(safetensors.SafetensorError, match="bogus"):
        safetensors.safe_open(str(every_dtype), "pt", backend="bogus")


def test_integer_device_means_cuda(every_dtype: Path) -> None:
    if torch.cuda.is_available():
        with streamer.safe_open(every_dtype, "pt", 0) as ours:
            assert ours.get_tensor("F32").device == torch.device("cuda:0")
        assert streamer.load(every_dtype, 0)["F32"].device == torch.device("cuda:0")
    else:
        with pytest.raises(streamer.DeviceError, match="cuda:0"):
            streamer.safe_open(every_dtype, "pt", 0)
        with pytest.raises(streamer.DeviceError, match="cuda:0"):
            streamer.load_file(every_dtype, 0)


def test_load_file_takes_what_safetensors_takes(every_dtype: Path) -> None:
    expected = safetensors.torch.load_file(str(every_dtype))
    for filename in (str(every_dtype), every_dtype, pathlib.PurePath(every_dtype)):
        for kwargs in ({}, {"device": "cpu"}, {"device": torch.device("cpu")}, {"backend": "pread"}):
            assert_same_dict(streamer.load_file(filename, **kwargs), expected)  # type: ignore[arg-type]
    assert_same_dict(streamer.load_file(every_dtype, "cpu", backend="mmap"), expected)
    with pytest.raises(ConfigError, match="backend"):
        streamer.load_file(every_dtype, backend="bogus")


# --- get_slice ----------------------------------------------------------------------------------

NON_PACKED = sorted(TORCH_DTYPE)


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")  # torch's, for the str index
@pytest.mark.parametrize("name", NON_PACKED)
def test_get_slice_on_every_dtype_and_dim(opened: tuple[streamer.safe_open, Any], name: str) -> None:
    ours, theirs = opened
    mine, reference = ours.get_slice(name), theirs.get_slice(name)
    assert mine.get_shape() == reference.get_shape() == list(SHAPE)
    assert mine.get_dtype() == reference.get_dtype() == name
    for index in INDICES + BAD_INDICES:
        assert_same_outcome(lambda i=index: mine[i], lambda i=index: reference[i], f"{name}[{index!r}]")


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")
@pytest.mark.parametrize("index", ADVANCED_INDICES, ids=repr)
def test_get_slice_advanced_indices_read_the_tensor_and_index_it(
    opened: tuple[streamer.safe_open, Any], index: Any
) -> None:
    ours, theirs = opened
    assert_same_outcome(lambda: ours.get_slice("I16")[index], lambda: theirs.get_slice("I16")[index], "I16")


def test_get_slice_of_packed_f4_keeps_whole_bytes(opened: tuple[streamer.safe_open, Any]) -> None:
    """safetensors cannot slice F4 at all (a RuntimeError for any index); streamer slices in values
    (as ``get_shape`` counts them) and refuses, with a RuntimeError too, what would split a byte."""
    ours, theirs = opened
    packed = theirs.get_tensor("F4")  # torch shape (4, 6, 4): two values per element
    mine, reference = ours.get_slice("F4"), theirs.get_slice("F4")
    assert mine.get_shape() == reference.get_shape() == list(SHAPE)
    assert mine.get_dtype() == reference.get_dtype() == "F4"
    with pytest.raises(RuntimeError):
        reference[1:3]
    cases: list[tuple[Any, Any]] = [
        (slice(1, 3), (slice(1, 3),)),
        ((slice(None), slice(2, 5)), (slice(None), slice(2, 5))),
        ((Ellipsis, slice(2, 6)), (Ellipsis, slice(1, 3))),
        ((1, slice(None, None, 2), slice(4, None)), (1, slice(None, None, 2), slice(2, None))),
        ((slice(3, 3),), (slice(3, 3),)),
    ]
    for index, torch_index in cases:
        assert_same(mine[index], packed[torch_index], repr(index))
    for index in [(Ellipsis, slice(1, 3)), (Ellipsis, 2), (Ellipsis, slice(None, None, 2)), (Ellipsis, None)]:
        with pytest.raises(PackedSliceError, match="packed") as info:
            mine[index]
        assert isinstance(info.value, RuntimeError)
    with pytest.raises(PackedSliceError):
        mine[[0, 1]]
    with pytest.raises(IndexError):  # torch's own errors come first
        mine[9]


def _component(size: int) -> st.SearchStrategy[Any]:
    bound = st.one_of(st.none(), st.integers(-size - 2, size + 2))
    return st.one_of(
        st.integers(-size, size - 1),
        st.builds(slice, bound, bound, st.sampled_from([None, 1, 2, 3])),
    )


@st.composite
def basic_indices(draw: st.DrawFn) -> Any:
    parts = [draw(_component(size)) for size in SHAPE[: draw(st.integers(0, len(SHAPE)))]]
    if draw(st.booleans()):
        parts.insert(draw(st.integers(0, len(parts))), Ellipsis)
    if draw(st.booleans()):
        parts.insert(draw(st.integers(0, len(parts))), None)
    return tuple(parts)


@settings(max_examples=60, deadline=None)
@given(index=basic_indices(), name=st.sampled_from(["F64", "BF16", "U8", "BOOL", "C64", "F8_E5M2"]))
def test_get_slice_matches_safetensors_for_any_basic_index(every_dtype: Path, index: Any, name: str) -> None:
    with (
        streamer.safe_open(every_dtype, config=config()) as ours,
        safetensors.safe_open(str(every_dtype), "pt") as theirs,
    ):
        assert_same_outcome(lambda: ours.get_slice(name)[index], lambda: theirs.get_slice(name)[index], name)


# --- bytes read ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A 32 MiB tensor between two small ones (the ratio is what matters, not the size)."""
    g = torch.Generator().manual_seed(5)
    weight = random_tensor((1024, 8 * KiB), torch.int32, g)
    path = tmp_path_factory.mktemp("large") / "large.safetensors"
    tensors = {
        "a": random_tensor((5,), torch.int32, g),
        "weight": weight,
        "z": random_tensor((7,), torch.int8, g),
    }
    safetensors.torch.save_file(tensors, str(path))
    return path, weight


@pytest.mark.parametrize("block_size", [64 * KiB, 8 * MiB])
def test_an_eighth_of_the_rows_reads_an_eighth_of_the_bytes(
    large: tuple[Path, torch.Tensor], block_size: int
) -> None:
    path, weight = large
    with streamer.safe_open(path, config=config(block_size=block_size)) as handle:
        piece = handle.get_slice("weight")
        for rank in (0, 3, 7):
            got = piece[rank * 128 : (rank + 1) * 128]
            assert_same(got, weight[rank * 128 : (rank + 1) * 128])
            metrics = handle.handle.metrics
            assert metrics["bytes"] == weight.nbytes // 8
            # One read of the eighth, rounded out to 4 KiB at each end at most.
            assert weight.nbytes // 8 <= metrics["bytes_read"] <= weight.nbytes // 8 + 8 * KiB
            assert metrics["blocks"] <= -(-weight.nbytes // 8 // block_size) + 1


def test_an_eighth_of_the_rows_of_a_1_gib_tensor_reads_an_eighth_of_it(tmp_path: Path) -> None:
    """The size a tensor-parallel rank meets: a 1 GiB BF16 weight in a sparse file (only a stripe
    of random bytes at each eighth's start and end is written, so the file costs no disk), each
    rank's eighth of the rows compared with safetensors' ``get_slice`` and read as one eighth."""
    rows, cols = 16 * KiB, 32 * KiB
    size = rows * cols * 2
    header = json.dumps({"weight": {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, size]}})
    header += " " * (-len(header) % 8)
    path = tmp_path / "sparse-1GiB.safetensors"
    g = torch.Generator().manual_seed(29)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        data_start = f.tell()
        f.truncate(data_start + size)
        for eighth in range(8):
            for at in (eighth * size // 8, (eighth + 1) * size // 8 - 64 * KiB):
                f.seek(data_start + at)
                f.write(raw_bytes(random_tensor((32 * KiB,), torch.bfloat16, g)))
    share = rows // 8
    with (
        streamer.safe_open(path, config=config(block_size=8 * MiB)) as handle,
        safetensors.safe_open(str(path), framework="pt") as reference,
    ):
        for rank in (0, 5, 7):
            got = handle.get_slice("weight")[rank * share : (rank + 1) * share]
            assert_same(got, reference.get_slice("weight")[rank * share : (rank + 1) * share])
            assert size // 8 <= handle.handle.metrics["bytes_read"] <= size // 8 + 8 * KiB
            del got


def test_a_column_slice_reads_no_more_than_its_covering_rows(large: tuple[Path, torch.Tensor]) -> None:
    path, weight = large
    row = weight[0].nbytes
    with streamer.safe_open(path, config=config(block_size=64 * KiB)) as handle:
        got = handle.get_slice("weight")[256:512, 1024:2048]
        assert_same(got, weight[256:512, 1024:2048])
        assert handle.handle.metrics["bytes_read"] <= 256 * row + 8 * KiB
        # The result owns just its bytes: a shard does not pin the rows it was cut from.
        assert got.untyped_storage().nbytes() == got.nbytes
        column = handle.get_slice("weight")[:, -1]
        assert_same(column, weight[:, -1])
        assert handle.handle.metrics["bytes_read"] <= weight.nbytes + 8 * KiB


def test_a_column_shard_through_the_device_ring_reads_its_strided_ranges(
    large: tuple[Path, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged (GPU) path, with the CPU stand-in copy engine as the device: a 1/8 column shard
    of 32 KiB rows reads its runs, not the rows that cover them, as the CPU path does."""
    StandIn(monkeypatch)
    path, weight = large
    with streamer.safe_open(path, config=config(block_size=64 * KiB, memory_limit=MiB)) as handle:
        width = weight.shape[1] // 8
        got = handle.get_slice("weight")[:, 3 * width : 4 * width]
        assert_same(got, weight[:, 3 * width : 4 * width])
        # Each 4 KiB run reads at most its two aligned pages: a quarter, not the whole weight.
        assert weight.nbytes // 8 <= handle.handle.metrics["bytes_read"] <= weight.nbytes // 4 + 8 * KiB


def test_slices_far_apart_are_read_run_by_run(tmp_path: Path) -> None:
    """A middle-dim shard of a stacked weight (experts x rows x cols): 128 KiB runs 384 KiB apart,
    read one by one (each in the reader's 64 KiB blocks, one more for where the run starts), not
    as the 1.6 MiB that covers them."""
    g = torch.Generator().manual_seed(9)
    stacked = random_tensor((4, 512, 1024), torch.uint8, g)  # 512 KiB per expert
    path = tmp_path / "stacked.safetensors"
    safetensors.torch.save_file({"experts": stacked}, str(path))
    with streamer.safe_open(path, config=config(block_size=64 * KiB)) as handle:
        got = handle.get_slice("experts")[:, 128:256]
        assert_same(got, stacked[:, 128:256])
        assert 4 * 128 * KiB <= handle.handle.metrics["bytes_read"] <= 4 * (128 + 64) * KiB
        with safetensors.safe_open(str(path), "pt") as theirs:
            assert_same(got, theirs.get_slice("experts")[:, 128:256])


@pytest.mark.parametrize("dtype", ["F64", "F32", "BF16", "F16", "I8", "U8", "BOOL", "F8_E4M3"])
def test_strided_column_and_middle_slices_are_bit_exact(tmp_path: Path, dtype: str) -> None:
    """Rows of 32 KiB and more: column and middle-dim slices read as strided ranges (local files in
    the page cache: a gap longer than ``LOCAL_CACHED_READ_COST`` is skipped), every bit as
    safetensors gives it."""
    g = torch.Generator().manual_seed(21)
    itemsize = TORCH_DTYPE[dtype].itemsize
    tensor = random_tensor((6, 3, 32 * KiB // itemsize), TORCH_DTYPE[dtype], g)
    path = tmp_path / "strided.safetensors"
    safetensors.torch.save_file({"head": random_tensor((3,), torch.int8, g), "t": tensor}, str(path))
    width = tensor.shape[-1]
    indices = [
        (slice(None), slice(None), slice(0, width // 8)),
        (Ellipsis, slice(width // 2, width // 2 + 1000)),
        (slice(None), 1),
        (slice(1, 5), slice(0, 2), slice(100, 2000, 3)),
        (slice(None), slice(None, None, 2), -1),
    ]
    with streamer.safe_open(path, config=config()) as ours, safetensors.safe_open(str(path), "pt") as theirs:
        for index in indices:
            got = ours.get_slice("t")[index]
            assert_same(got, theirs.get_slice("t")[index], str(index))
            assert_same(got, tensor[index], str(index))
            assert got.is_contiguous()
            assert ours.handle.metrics["bytes_read"] < tensor.nbytes // 2, str(index)


@pytest.mark.parametrize("io_mode", ["direct", "buffered"])
def test_shards_of_rows_off_the_alignment_are_bit_exact(tmp_path: Path, io_mode: str) -> None:
    """Rows of 102412 bytes: each strided range starts at another offset in its 4 KiB page, so the
    ranges lie unevenly in the packed buffer (O_DIRECT rounds each out to whole pages). Buffered
    reads move exactly the bytes wanted; direct ones at most two pages more per range."""
    g = torch.Generator().manual_seed(23)
    tensor = random_tensor((48, 25603), torch.float32, g)
    path = tmp_path / "unaligned.safetensors"
    safetensors.torch.save_file({"t": tensor}, str(path))
    cfg = StreamerConfig(concurrency=3, io_mode=io_mode)
    for index in [(slice(None), slice(1000, 5000)), (slice(3, 40, 2), slice(25000, None))]:
        with streamer.safe_open(path, config=cfg) as ours, safetensors.safe_open(str(path), "pt") as theirs:
            got = ours.get_slice("t")[index]
            assert_same(got, theirs.get_slice("t")[index], str(index))
            wanted = tensor[index].nbytes
            read = ours.handle.metrics["bytes_read"]
            if io_mode == "buffered":
                assert read == wanted, str(index)
            else:
                assert wanted <= read <= wanted + got.shape[0] * 8 * KiB, str(index)


@pytest.mark.parametrize("io_mode", ["direct", "buffered"])
def test_slices_of_a_tensor_off_its_dtype_alignment(tmp_path: Path, io_mode: str) -> None:
    """A float32 weight starting 3 bytes into the data section (after a 3-byte tensor): shards and
    row slices come out exact, aligned and contiguous, packed with or without O_DIRECT padding."""
    g = torch.Generator().manual_seed(24)
    small, _ = raw_entry("u8", "U8", (3,), generator=g)
    entry, weight = raw_entry("w", "F32", (32, 32 * KiB), generator=g)
    path = tmp_path / "off.safetensors"
    layout = write_raw(path, [small, entry], data_start_mod8=0)
    assert layout["w"][0] % 4 == 3
    with streamer.safe_open(path, config=StreamerConfig(concurrency=3, io_mode=io_mode)) as handle:
        for index in [(slice(None), slice(0, 1024)), (slice(3, 9),), (slice(None), slice(100, 200, 3)), 5]:
            got = handle.get_slice("w")[index]
            assert_same(got, weight[index], str(index))
            assert got.is_contiguous() and got.data_ptr() % 4 == 0


def test_unevenly_spaced_runs_in_one_range(tmp_path: Path) -> None:
    """Experts far apart, rows of one expert close but unevenly spaced: each expert is one range
    holding runs 4, 12 and 16 KiB from its first."""
    g = torch.Generator().manual_seed(22)
    stacked = random_tensor((3, 4, 3, 4 * KiB), torch.uint8, g)
    path = tmp_path / "uneven.safetensors"
    safetensors.torch.save_file({"experts": stacked}, str(path))
    index = (slice(None), slice(0, 2), slice(0, 2), slice(0, KiB))
    with streamer.safe_open(path, config=config()) as handle:
        assert_same(handle.get_slice("experts")[index], stacked[index])
        assert handle.handle.metrics["bytes_read"] <= 3 * 20 * KiB


def test_an_eighth_of_the_columns_reads_an_eighth_of_the_bytes(tmp_path: Path) -> None:
    """A 32 MiB weight of 128 KiB rows: the 1/8 column shard of a rank is 256 strided reads of
    16 KiB, each rounded out to the 4 KiB alignment (one more 4 KiB at most), not the whole."""
    g = torch.Generator().manual_seed(23)
    weight = random_tensor((256, 64 * KiB), torch.bfloat16, g)
    path = tmp_path / "wide.safetensors"
    safetensors.torch.save_file({"a": random_tensor((5,), torch.int8, g), "weight": weight}, str(path))
    k = weight.shape[1] // 8
    with streamer.safe_open(path, config=config(block_size=8 * MiB)) as handle:
        for rank in (0, 3, 7):
            got = handle.get_slice("weight")[:, rank * k : (rank + 1) * k]
            assert_same(got, weight[:, rank * k : (rank + 1) * k])
            metrics = handle.handle.metrics
            assert weight.nbytes // 8 <= metrics["bytes_read"] <= weight.nbytes // 8 + 256 * 4 * KiB
            assert metrics["blocks"] <= 2 * 256


def test_a_contiguous_slice_is_a_view_of_the_bytes_read(large: tuple[Path, torch.Tensor]) -> None:
    path, weight = large
    with streamer.safe_open(path, config=config()) as handle:
        rows = handle.get_slice("weight")[2:4]
        assert rows.is_contiguous()
        storage = rows.untyped_storage()
        # A view: the bytes sit where the read put them (the buffer's alignment slack around them).
        assert storage.nbytes() >= rows.nbytes and storage.data_ptr() <= rows.data_ptr()
        assert_same(rows, weight[2:4])


# --- S3 -----------------------------------------------------------------------------------------

BUCKET = "dropin"
CREDENTIALS = ("AKIDDROPINTEST", "dropin/secret", "dropin-token")


def test_get_slice_from_s3_reads_only_its_rows(s3_server: str, large: tuple[Path, torch.Tensor]) -> None:
    pytest.importorskip("boto3")
    path, weight = large
    client = s3_client(s3_server, CREDENTIALS[0], CREDENTIALS[1])
    client.create_bucket(Bucket=BUCKET)
    client.upload_file(str(path), BUCKET, "large.safetensors")
    cfg = StreamerConfig(concurrency=2, block_size=256 * KiB, s3=loopback_s3_config(s3_server, CREDENTIALS))
    uri = f"s3://{BUCKET}/large.safetensors"
    with streamer.safe_open(uri, config=cfg) as handle:
        assert handle.keys() == ["a", "weight", "z"]
        piece = handle.get_slice("weight")
        got = piece[512:640]
        assert_same(got, weight[512:640])
        metrics = handle.handle.metrics
        assert metrics["s3_files"] == 1
        assert weight.nbytes // 8 <= metrics["bytes_read"] <= weight.nbytes // 8 + 8 * KiB
        assert_same(piece[:16, 4096:], weight[:16, 4096:])
        assert_same(handle.get_tensor("z"), safetensors.torch.load_file(str(path))["z"])
        with pytest.raises(MissingTensorError, match=re.escape(uri)):
            handle.get_tensor("nope")
    assert_same(piece[-1], weight[-1])  # a slice outlives its handle, as safetensors' do
    until = time.monotonic() + 5  # and that read let go of the S3 client it reopened
    while any(t.name == "streamer-s3" for t in threading.enumerate()) and time.monotonic() < until:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name == "streamer-s3"]


def test_get_slice_on_a_sharded_checkpoint(tmp_path: Path) -> None:
    """Our extension: any source ``streamer.open`` takes; slices read from the shard holding them."""
    g = torch.Generator().manual_seed(3)
    tensors = {f"layer{i}": random_tensor((16, 32), torch.float16, g) for i in range(4)}
    for i, chunk in enumerate((["layer0", "layer1"], ["layer2", "layer3"])):
        safetensors.torch.save_file({n: tensors[n] for n in chunk}, str(tmp_path / f"part{i}.safetensors"))
    with streamer.safe_open(tmp_path) as handle:
        assert handle.keys() == sorted(tensors)
        for name, tensor in tensors.items():
            assert_same(handle.get_slice(name)[4:8, ::3], tensor[4:8, ::3], name)
    assert os.path.isdir(tmp_path)


def test_s3_column_slices_follow_the_request_cost(s3_server: str, tmp_path: Path) -> None:
    """On S3 a request costs ~4 MiB of transfer: columns of short rows read the covering rows in
    a few GETs; columns of 6 MiB rows skip the 5 MiB between their runs (~1/8 of the bytes)."""
    pytest.importorskip("boto3")
    g = torch.Generator().manual_seed(24)
    short = random_tensor((1024, 1024), torch.int32, g)  # 4 KiB rows
    wide = random_tensor((4, 6 * MiB), torch.uint8, g)  # 6 MiB rows
    path = tmp_path / "columns.safetensors"
    safetensors.torch.save_file({"short": short, "wide": wide}, str(path))
    client = s3_client(s3_server, CREDENTIALS[0], CREDENTIALS[1])
    client.create_bucket(Bucket="columns")
    client.upload_file(str(path), "columns", "columns.safetensors")
    cfg = StreamerConfig(concurrency=2, s3=loopback_s3_config(s3_server, CREDENTIALS))  # 8 MiB blocks
    with streamer.safe_open("s3://columns/columns.safetensors", config=cfg) as handle:
        assert_same(handle.get_slice("short")[:, 128:256], short[:, 128:256])
        metrics = handle.handle.metrics
        assert metrics["requests"] <= 2
        assert metrics["bytes_read"] <= short.nbytes
        k = wide.shape[1] // 8
        assert_same(handle.get_slice("wide")[:, 3 * k : 4 * k], wide[:, 3 * k : 4 * k])
        metrics = handle.handle.metrics
        assert wide.nbytes // 8 <= metrics["bytes_read"] <= wide.nbytes // 8 + 4 * 8 * KiB
        assert metrics["requests"] <= 8  # one per run, two where a run crosses a block line

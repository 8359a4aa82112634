"""The format layer against real files: round trips through safetensors, and every malformed case."""

from __future__ import annotations

import json
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from streamer.errors import ConfigError, HeaderError, ReadError, SourceError, TruncatedFileError
from streamer.format.dtypes import DTYPES, DType, dtype_from_torch
from streamer.format.safetensors import (
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    FileHeader,
    header_length,
    parse_header,
    read_header,
)

# --- helpers ---------------------------------------------------------------------------------


def raw(header: bytes | str | dict[str, Any], data: bytes = b"", *, length: int | None = None) -> bytes:
    """File bytes: 8-byte prefix (``length`` overrides the true header length), header, data."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def write(tmp_path: Path, content: bytes, name: str = "model.safetensors") -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def entry(dtype: Any, shape: Any, begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs included): the format layer never looks at values."""
    numel = 1
    for d in shape:
        numel *= d
    raw_bytes = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw_bytes = raw_bytes % 2
    return raw_bytes.view(dtype).reshape(shape)


def check_against_safetensors(path: str, header: FileHeader) -> None:
    """Keys, dtypes, shapes and metadata as safetensors reports them; offsets computed by hand."""
    data = Path(path).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    doc = json.loads(data[8 : 8 + n])
    assert header.path == path
    assert header.file_size == len(data)
    assert header.data_start == 8 + n
    with safe_open(path, framework="pt") as f:
        assert sorted(t.name for t in header.tensors) == sorted(f.keys())
        assert header.metadata == (f.metadata() or {})
        for t in header.tensors:
            sl = f.get_slice(t.name)
            assert t.dtype.name == sl.get_dtype()
            assert list(t.shape) == header_shape_to_torch(sl.get_shape(), t.dtype)
            assert t.shape == tuple(f.get_tensor(t.name).shape)
            fields = doc[t.name]
            begin, end = fields["data_offsets"] if isinstance(fields, dict) else fields[2]
            assert (t.begin, t.end) == (8 + n + begin, 8 + n + end)
            assert t.nbytes == end - begin
            expected = f.get_tensor(t.name).contiguous().view(-1).view(torch.uint8)
            assert data[t.begin : t.end] == bytes(expected.tolist())
    assert list(header.tensors) == sorted(header.tensors, key=lambda t: (t.begin, t.end, t.name))


def header_shape_to_torch(shape: list[int], dtype: DType) -> list[int]:
    """F4 packs two values per torch element: safetensors' header counts values, torch elements."""
    return shape if dtype.per_item == 1 else [*shape[:-1], shape[-1] // dtype.per_item]


# --- dtypes ----------------------------------------------------------------------------------


def test_dtype_table_matches_torch_and_safetensors() -> None:
    # F8_E8M0 and F4 are mapped by safetensors' Rust side, not by its Python _TYPES table.
    assert set(DTYPES) == set(safetensors.torch._TYPES) | {"F8_E8M0", "F4"}
    assert {name for name, dt in DTYPES.items() if dt.per_item != 1} == {"F4"}
    assert (DTYPES["F4"].torch_dtype, DTYPES["F4"].bits) == (torch.float4_e2m1fn_x2, 4)
    for name, dt in DTYPES.items():
        assert dt.name == name
        assert dt.itemsize == torch.empty(0, dtype=dt.torch_dtype).element_size()
        if name in safetensors.torch._TYPES:
            assert dt.torch_dtype == safetensors.torch._TYPES[name]
        assert dtype_from_torch(dt.torch_dtype) is dt
    assert DTYPES["F8_E8M0"].torch_dtype == torch.float8_e8m0fnu


@pytest.mark.parametrize("bad", [torch.complex128, torch.qint8, "float32", None, []])
def test_dtype_from_torch_rejects_unknown(bad: Any) -> None:
    with pytest.raises(ConfigError, match="no safetensors equivalent"):
        dtype_from_torch(bad)


def test_dtype_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        DTYPES["X"] = DType("X", torch.float32, 4)  # type: ignore[index]


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_round_trip_each_dtype(tmp_path: Path, name: str) -> None:
    dtype = DTYPES[name].torch_dtype
    tensors = {
        "scalar": random_tensor((1,) if name == "F4" else (), dtype),  # half a byte cannot be stored
        "vector": random_tensor((7,), dtype),
        "matrix": random_tensor((3, 5), dtype),
        "empty": random_tensor((0, 4), dtype),
        "cube": random_tensor((2, 3, 4), dtype),
    }
    path = str(tmp_path / f"{name}.safetensors")
    safetensors.torch.save_file(tensors, path)
    header = read_header(path)
    check_against_safetensors(path, header)
    assert header.tensor("scalar").shape == ((1,) if name == "F4" else ())
    assert header.tensor("empty").nbytes == 0
    assert all(t.dtype is DTYPES[name] for t in header.tensors)


def test_round_trip_mixed_dtypes_with_metadata(tmp_path: Path) -> None:
    tensors = {
        f"layer.{i}.{n}": random_tensor((i + 1, 3), DTYPES[n].torch_dtype) for i, n in enumerate(DTYPES)
    }
    metadata = {"format": "pt", "note": "ünïcødé ✓", "empty": ""}
    path = str(tmp_path / "mixed.safetensors")
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    header = read_header(Path(path))  # PathLike works too
    assert header.metadata == metadata
    check_against_safetensors(path, header)


def test_round_trip_many_tiny_tensors(tmp_path: Path) -> None:
    tensors = {f"t{i:04d}": random_tensor((i % 3,), torch.float16) for i in range(1500)}
    tensors.update({f"s{i}": random_tensor((), torch.int8) for i in range(50)})
    path = str(tmp_path / "tiny.safetensors")
    safetensors.torch.save_file(tensors, path)
    header = read_header(path)
    assert len(header.tensors) == len(tensors)
    check_against_safetensors(path, header)


def test_round_trip_no_tensors(tmp_path: Path) -> None:
    path = str(tmp_path / "none.safetensors")
    safetensors.torch.save_file({}, path, metadata={"a": "b"})
    header = read_header(path)
    assert header.tensors == ()
    assert header.metadata == {"a": "b"}


def test_hand_built_f8_e8m0(tmp_path: Path) -> None:
    data = bytes([127, 128, 0, 255, 1, 2])
    path = write(tmp_path, raw({"scales": entry("F8_E8M0", [2, 3], 0, 6)}, data))
    header = read_header(path)
    (t,) = header.tensors
    assert (t.name, t.dtype.torch_dtype, t.shape) == ("scales", torch.float8_e8m0fnu, (2, 3))
    assert (t.begin, t.end) == (header.data_start, header.data_start + 6)
    with safe_open(path, framework="pt") as f:
        loaded = f.get_tensor("scales")
    assert loaded.dtype == torch.float8_e8m0fnu
    assert loaded.view(torch.uint8).flatten().tolist() == list(data)


def test_hand_built_f4_has_safetensors_torch_shape(tmp_path: Path) -> None:
    # 2 x 6 four-bit values: 6 bytes; torch's float4_e2m1fn_x2 holds two per element, so [2, 3].
    data = bytes([0x12, 0x34, 0x56, 0x78, 0x9A, 0xBC])
    doc = {"w": entry("F4", [2, 6], 0, 6), "e": entry("F4", [4, 0], 6, 6)}
    path = write(tmp_path, raw(doc, data))
    header = read_header(path)
    assert [(t.name, t.dtype.name, t.shape, t.nbytes) for t in header.tensors] == [
        ("w", "F4", (2, 3), 6),
        ("e", "F4", (4, 0), 0),
    ]
    check_against_safetensors(path, header)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([], "does not end on a byte boundary"),
        ([3], "does not end on a byte boundary"),
        ([2, 3], "last dimension must be divisible by 2"),
        ([0, 3], "last dimension must be divisible by 2"),
    ],
)
def test_f4_shapes_torch_cannot_hold(tmp_path: Path, shape: list[int], message: str) -> None:
    nbytes = (math.prod(shape) + 1) // 2
    path = write(tmp_path, raw({"w": entry("F4", shape, 0, nbytes)}, bytes(nbytes)))
    with pytest.raises(HeaderError, match=message) as info:
        read_header(path)
    assert (info.value.path, info.value.tensor) == (path, "w")
    with pytest.raises(Exception):  # noqa: B017 - safetensors refuses it too, in its own way
        safetensors.torch.load_file(path)


# --- legal but unusual -----------------------------------------------------------------------


@pytest.mark.parametrize("padding", [(b"", b"   "), (b" \n\t\r", b""), (b"\n", b"\r\n  ")])
def test_padding_extra_fields_and_empty_names_are_legal(tmp_path: Path, padding: tuple[bytes, bytes]) -> None:
    # JSON whitespace on either side of the header (writers pad it; safetensors accepts both),
    # fields it does not know, a name that only looks like metadata, the empty name.
    doc = {
        "b": {**entry("F32", [2], 5, 13), "extra": {"nested": [1, 2.5, None, -0, 10**30]}},
        "a": entry("U8", [3], 0, 3),
        "__metadata__": {"k": "v"},
        "__not_metadata__": entry("I16", [], 3, 5),
        "": entry("U8", [0], 13, 13),
    }
    header_bytes = padding[0] + json.dumps(doc).encode() + padding[1]
    path = write(tmp_path, raw(header_bytes, bytes(range(13))))
    header = read_header(path)
    start = 8 + len(header_bytes)
    assert header.data_start == start
    assert [(t.name, t.begin - start, t.end - start) for t in header.tensors] == [
        ("a", 0, 3),
        ("__not_metadata__", 3, 5),
        ("b", 5, 13),
        ("", 13, 13),
    ]
    assert header.metadata == {"k": "v"}
    check_against_safetensors(path, header)


def test_numbers_in_unknown_fields_as_serde_reads_them(tmp_path: Path) -> None:
    # Beyond u64 an integer is a float to serde_json, fine where nothing needs an integer; so is a
    # float with 500 digits. Only a number that overflows a float is an error.
    extra = b'{"big": ' + b"9" * 300 + b', "tiny": 0.' + b"0" * 500 + b'1, "neg": -0}'
    header_bytes = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": ' + extra + b"}}"
    path = write(tmp_path, raw(header_bytes, b"z"))
    check_against_safetensors(path, read_header(path))


def test_serde_spellings_safetensors_accepts(tmp_path: Path) -> None:
    # serde reads a struct from an array of its fields and an enum from {"VARIANT": null}.
    header_bytes = (
        b'{"a": ["U8", [2], [0, 2]], "b": {"dtype": {"I16": null}, "shape": [], "data_offsets": [2, 4]}}'
    )
    path = write(tmp_path, raw(header_bytes, b"wxyz"))
    header = read_header(path)
    assert [(t.name, t.dtype.name, t.shape) for t in header.tensors] == [("a", "U8", (2,)), ("b", "I16", ())]
    check_against_safetensors(path, header)


def test_zero_size_tensors_sit_between_tensors_and_ties_sort_by_name(tmp_path: Path) -> None:
    doc = {
        "z2": entry("F32", [0], 4, 4),
        "big": entry("U8", [4], 0, 4),
        "z1": entry("F64", [3, 0], 4, 4),
        "z0": entry("BF16", [0], 0, 0),
        "after": entry("U8", [0], 8, 8),
        "small": entry("U8", [4], 4, 8),
    }
    path = write(tmp_path, raw(doc, bytes(8)))
    header = read_header(path)
    assert [t.name for t in header.tensors] == ["z0", "big", "z1", "z2", "small", "after"]
    check_against_safetensors(path, header)


@pytest.mark.parametrize(
    "shape", [[0, 2**63 - 1], [0, 2**62, 4], [2**63 - 1, 0, 2**63 - 1], [0, 2**32, 2**32, 2**32]]
)
def test_zero_size_tensors_with_huge_dims_load_like_safetensors(tmp_path: Path, shape: list[int]) -> None:
    path = write(tmp_path, raw({"e": entry("U8", shape, 0, 0)}))
    header = read_header(path)
    assert header.tensor("e").shape == tuple(shape)
    check_against_safetensors(path, header)


def test_null_metadata_means_none(tmp_path: Path) -> None:
    # safetensors accepts this (serde reads null as "absent"), so we do too.
    header = read_header(write(tmp_path, raw({"__metadata__": None, "a": entry("U8", [1], 0, 1)}, b"x")))
    assert header.metadata == {}


def test_tensor_lookup(tmp_path: Path) -> None:
    path = write(tmp_path, raw({"w": entry("I32", [2], 0, 8)}, bytes(8)))
    header = read_header(path)
    assert header.tensor("w").nbytes == 8
    assert hash(header) == hash(read_header(path))  # usable as a dict key / in a set
    with pytest.raises(SourceError, match="no tensor named 'nope'") as info:
        header.tensor("nope")
    assert (info.value.path, info.value.tensor) == (path, "nope")


def test_pure_functions_on_bytes() -> None:
    content = raw({"w": entry("F16", [4], 0, 8)}, bytes(8))
    n = header_length(content[:PREFIX_BYTES], path="s3://bucket/key", file_size=len(content))
    header = parse_header(content[8 : 8 + n], path="s3://bucket/key", file_size=len(content))
    assert header.path == "s3://bucket/key"
    assert header.tensor("w").begin == 8 + n
    # The data section need not be present in memory: only file_size matters.
    again = parse_header(content[8 : 8 + n], path="p", file_size=len(content))
    assert again == FileHeader("p", header.file_size, header.data_start, header.tensors, {})


# --- malformed headers -----------------------------------------------------------------------

W = entry("F32", [2], 0, 8)  # a valid 8-byte tensor, present next to each bad entry "x" below


def with_x(x: Any, data_bytes: int) -> bytes:
    """A file whose tensor "w" is fine and whose tensor "x" is ``x``."""
    return raw({"w": W, "x": x}, bytes(data_bytes))


def case(case_id: str, content: bytes, message: str, tensor: str | None = None) -> Any:
    """One malformed file: ``message`` must occur in the error, ``tensor`` is the expected attribute."""
    return pytest.param(content, message, tensor, id=case_id)


DEEP = b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
DUPLICATE_FIELD = b'{"w": {"dtype": "F32", "dtype": "F16", "shape": [2], "data_offsets": [0, 8]}}'

# The length prefix off by one, with the JSON still valid thanks to its padding: the data section
# would start one byte early, so every tensor would be read shifted.
SHORT_BY_ONE = b'{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}} '

MALFORMED = [
    # the length prefix
    case("empty file", b"", "file is 0 bytes, too short"),
    case("7 byte file", b"\x02\x00\x00\x00\x00\x00\x00", "file is 7 bytes, too short"),
    case("header length 0", raw(b"", bytes(8)), "header length is 0"),
    case("over cap", raw(b"{}", length=MAX_HEADER_BYTES + 1), f"exceeds the limit of {MAX_HEADER_BYTES}"),
    case("u64 max length", raw(b"{}", length=2**64 - 1), "exceeds the limit"),
    case("past eof", raw(b"{}", length=3), "header length 3 runs past the end of the file (10 bytes"),
    case(
        "length one short",
        raw(SHORT_BY_ONE, b"x", length=len(SHORT_BY_ONE) - 1),
        "1 bytes after the last tensor",
        "w",
    ),
    case("length one long", raw(SHORT_BY_ONE, b"xy", length=len(SHORT_BY_ONE) + 1), "not valid JSON"),
    # text and JSON
    case("bad utf-8", raw(b'{"\xff": 1}'), "not valid UTF-8"),
    case("utf-8 surrogate bytes", raw(b'{"\xed\xa0\x80": 1}'), "not valid UTF-8"),
    case("not json", raw(b"{not json}"), "not valid JSON"),
    case("truncated json", raw(b'{"w": {"dtype": "F32"'), "not valid JSON"),
    case("trailing garbage", raw(b"{} x"), "not valid JSON"),
    case("trailing nul padding", raw(b"{}\x00\x00"), "not valid JSON"),
    case("leading nul padding", raw(b"\x00{}"), "not valid JSON"),
    case("float out of range", raw(b'{"w": {"x": 1e400}}'), "number 1e400 is out of range"),
    case("int out of range", raw(b'{"w": {"x": ' + b"9" * 310 + b"}}"), "is out of range"),
    case(
        "deep extra field",
        raw(b'{"w": {"x": ' + b"[" * 126 + b"]" * 126 + b"}}"),
        "deeper than serde_json's 127 levels",
        "w",
    ),
    case("surrogate in extra field", raw(b'{"w": {"x": "\\udfff"}}'), "unpaired surrogate", "w"),
    case("NaN", raw(b'{"w": NaN}'), "NaN is not a JSON value"),
    case("Infinity", raw(b'{"__metadata__": {"a": -Infinity}}'), "-Infinity is not a JSON value"),
    case("array at top", raw(b"[]"), "header must be a JSON object, got []"),
    case("string at top", raw(b' "{}"'), 'header must be a JSON object, got "{}"'),
    case("bom", raw("\ufeff{}".encode()), "Unexpected UTF-8 BOM"),
    case("deep nesting", raw(DEEP), "not valid JSON"),
    case(
        "huge int",
        raw(b'{"w": {"shape": [' + b"9" * 5000 + b"]}}"),
        "literal of 5000 characters is out of range",
    ),
    # repeated keys
    case("duplicate tensor", raw(b'{"w": 1, "x": 2, "w": 3}'), "'w' appears more than once", "w"),
    case("duplicate metadata", raw(b'{"__metadata__": {}, "__metadata__": {}}'), "'__metadata__' appears"),
    case("duplicate metadata key", raw(b'{"__metadata__": {"a": "1", "a": "2"}}'), "the key 'a' twice"),
    case("duplicate field", raw(DUPLICATE_FIELD, bytes(8)), "the field 'dtype' twice", "w"),
    # __metadata__
    case("metadata array", raw({"__metadata__": ["a"]}), "__metadata__ must be an object of strings"),
    case("metadata int value", raw({"__metadata__": {"a": 1}}), "__metadata__['a'] must be a string, got 1"),
    case("metadata nested", raw({"__metadata__": {"a": {}}}), "must be a string, got an object"),
    case("metadata surrogate", raw(b'{"__metadata__": {"a": "\\ud800"}}'), "unpaired surrogate"),
    case("metadata null entry", raw(b'{"__metadata__": {"a": null}}'), "must be a string, got null"),
    # names and entries
    case("entry not object", with_x([1, 2], 8), "entry must be an object", "x"),
    case("entry null", with_x(None, 8), "got null", "x"),
    case("entry array of 2", with_x(["U8", [0]], 8), "entry must be an object", "x"),
    case("surrogate name", raw(b'{"\\udc00": {}}'), "unpaired surrogate", "\udc00"),
    case("missing all", with_x({}, 8), "missing dtype, shape, data_offsets", "x"),
    case("missing offsets", with_x({"dtype": "F32", "shape": []}, 8), "missing data_offsets", "x"),
    # dtype
    case("unknown dtype", with_x(entry("F128", [], 8, 8), 8), 'unsupported dtype "F128"', "x"),
    case("F6", with_x(entry("F6_E2M3", [4], 8, 11), 11), "dtype F6_E2M3 has no torch equivalent", "x"),
    case(
        "dtype map repeated",
        raw(b'{"x": {"dtype": {"U8": null, "U8": null}, "shape": [0], "data_offsets": [0, 0]}}'),
        "unsupported dtype",
        "x",
    ),
    case("dtype map with value", with_x(entry({"U8": 1}, [0], 8, 8), 8), "unsupported dtype", "x"),
    case("dtype map of two", with_x(entry({"U8": None, "I8": None}, [0], 8, 8), 8), "unsupported dtype", "x"),
    case("lowercase dtype", with_x(entry("f32", [], 8, 12), 12), "unsupported dtype", "x"),
    case("dtype not str", with_x(entry(4, [], 8, 12), 12), "unsupported dtype 4", "x"),
    # shape
    case("shape not list", with_x(entry("U8", 3, 8, 11), 11), "shape must be an array", "x"),
    case("shape object", with_x(entry("U8", {}, 8, 8), 8), "got an object", "x"),
    case(
        "negative dim", with_x(entry("U8", [2, -1], 8, 8), 8), "shape[1] must be an integer >= 0, got -1", "x"
    ),
    case("bool dim", with_x(entry("U8", [True], 8, 9), 9), "shape[0] must be an integer >= 0, got true", "x"),
    case("float dim", with_x(entry("U8", [2.0], 8, 10), 10), "got 2.0", "x"),
    case(
        "minus zero dim",
        raw(b'{"w": {"dtype": "U8", "shape": [-0], "data_offsets": [0, 0]}}'),
        "got -0.0",
        "w",
    ),
    case(
        "dim 2**64",
        with_x(entry("U8", [0, 2**64], 8, 8), 8),
        "shape[1] must be an integer >= 0, got 1.8",
        "x",
    ),
    case("dim 2**63", with_x(entry("U8", [0, 2**63], 8, 8), 8), "dimension torch cannot represent", "x"),
    case(
        "strides overflow", with_x(entry("F16", [0, 2**62, 2**63 - 1], 8, 8), 8), "beyond what torch can", "x"
    ),
    case(
        "overflow before 0",
        with_x(entry("U8", [2**62, 4, 0], 8, 8), 8),
        "overflows a 64-bit element count",
        "x",
    ),
    case("bytes overflow", with_x(entry("F64", [2**62], 8, 8), 8), "overflows a 64-bit byte count", "x"),
    case("string dim", with_x(entry("U8", ["2"], 8, 10), 10), 'got "2"', "x"),
    # data_offsets
    case("offsets not list", with_x({"dtype": "U8", "shape": [], "data_offsets": 8}, 9), "[begin, end]", "x"),
    case(
        "three offsets",
        with_x({"dtype": "U8", "shape": [], "data_offsets": [8, 9, 10]}, 10),
        "[8, 9, 10]",
        "x",
    ),
    case("one offset", with_x({"dtype": "U8", "shape": [], "data_offsets": [8]}, 9), "got [8]", "x"),
    case("bool offset", with_x(entry("U8", [1], False, True), 8), "got [false, true]", "x"),
    case("float offset", with_x(entry("U8", [1], 8.0, 9), 9), "got [8.0, 9]", "x"),
    case("negative offset", with_x(entry("U8", [1], -1, 0), 8), "integers >= 0, got [-1, 0]", "x"),
    case("begin after end", with_x(entry("U8", [0], 8, 4), 8), "[8, 4] must satisfy begin <= end", "x"),
    case("huge end", with_x(entry("U8", [4], 8, 2**70), 10), "integers >= 0, got [8, 1.18", "x"),
    # size
    case("too few bytes", with_x(entry("F32", [3], 8, 16), 16), "needs 12 bytes, but", "x"),
    case("too many bytes", with_x(entry("F32", [3], 8, 24), 24), "data_offsets [8, 24] span 16", "x"),
    case("scalar too big", with_x(entry("F64", [], 8, 24), 24), "shape [] of F64 needs 8 bytes", "x"),
    case("zero size span", with_x(entry("F32", [0], 8, 12), 12), "needs 0 bytes", "x"),
    case("astronomic", with_x(entry("U8", [10**18] * 1000, 8, 9), 9), "(1000 dims)] overflows", "x"),
    # coverage of the data section
    case(
        "overlap",
        with_x(entry("U8", [4], 4, 8), 8),
        "'x' (data_offsets [4, 8]) overlaps 'w' (data_offsets [0, 8])",
        "x",
    ),
    case("same span", raw({"w": W, "v": W}, bytes(8)), "tensor 'w' (data_offsets [0, 8]) overlaps 'v'", "w"),
    case(
        "gap first",
        raw({"w": entry("U8", [1], 1, 2)}, bytes(2)),
        "leaves 1 bytes unclaimed after the start",
        "w",
    ),
    case("gap", with_x(entry("U8", [1], 9, 10), 10), "leaves 1 bytes unclaimed after 'w'", "x"),
    case(
        "zero size inside", with_x(entry("U8", [0], 4, 4), 8), "'x' (data_offsets [4, 4]) overlaps 'w'", "x"
    ),
    case("zero size past end", with_x(entry("U8", [0], 9, 9), 8), "leaves 1 bytes unclaimed", "x"),
    case("bytes after", with_x(entry("U8", [1], 8, 9), 10), "1 bytes after the last tensor", "x"),
    case("bytes and no tensors", raw(b"{}", b"\0"), "1 bytes after the last tensor"),
    case("bytes after a zero-size tensor", with_x(entry("U8", [0], 8, 8), 9), "1 bytes after the last", "x"),
]

# A file shorter than its header says: a HeaderError and a ReadError at once.
TRUNCATED = [
    case("past eof", raw(b"{}", length=3), "header length 3 runs past the end of the file (10 bytes"),
    case(
        "past file end", with_x(entry("U8", [4], 8, 12), 10), "need 12 data bytes, but the file holds 10", "x"
    ),
    case("one byte short", with_x(entry("U8", [1], 8, 9), 8), "need 9 data bytes, but the file holds 8", "x"),
    case(
        "zero size past end",
        with_x(entry("U8", [0], 8, 8), 0),
        "need 8 data bytes, but the file holds 0",
        "x",
    ),
]


@pytest.mark.parametrize(("content", "message", "tensor"), MALFORMED)
def test_malformed_header(tmp_path: Path, content: bytes, message: str, tensor: str | None) -> None:
    path = write(tmp_path, content)
    with pytest.raises(HeaderError) as info:
        read_header(path)
    err = info.value
    assert message in err.reason
    assert err.path == path
    assert err.tensor == tensor
    assert path in str(err)
    # The pure functions agree with read_header when handed the same bytes.
    with pytest.raises(HeaderError) as pure:
        n = header_length(content[:8], path=path, file_size=len(content))
        parse_header(content[8 : 8 + n], path=path, file_size=len(content))
    assert (pure.value.reason, pure.value.tensor) == (err.reason, err.tensor)


@pytest.mark.parametrize(("content", "message", "tensor"), TRUNCATED)
def test_truncated_file_is_header_and_read_error(
    tmp_path: Path, content: bytes, message: str, tensor: str | None
) -> None:
    path = write(tmp_path, content)
    with pytest.raises(TruncatedFileError) as info:
        read_header(path)
    assert isinstance(info.value, HeaderError) and isinstance(info.value, ReadError)
    assert message in info.value.reason
    assert (info.value.path, info.value.tensor) == (path, tensor)
    with pytest.raises(Exception):  # noqa: B017 - safetensors refuses it too, in its own way
        safetensors.torch.load_file(path)


def test_overlap_message_names_both_tensors(tmp_path: Path) -> None:
    doc = {"a": entry("U8", [10], 0, 10), "b": entry("U8", [3], 10, 13), "c": entry("U8", [4], 12, 16)}
    with pytest.raises(HeaderError) as info:
        read_header(write(tmp_path, raw(doc, bytes(16))))
    assert "'b'" in info.value.reason and "'c'" in info.value.reason
    assert info.value.tensor == "c"


def test_huge_digit_runs_fail_fast(tmp_path: Path) -> None:
    # int() is quadratic in the number of digits; the parser must refuse long literals up front.
    content = raw(b'{"w": {"dtype": "U8", "shape": [' + b"7" * 20_000_000 + b"]}}")
    start = time.perf_counter()
    with pytest.raises(HeaderError, match="literal of 20000000 characters is out of range"):
        read_header(write(tmp_path, content))
    assert time.perf_counter() - start < 60  # a hang guard: quadratic int() would take many minutes


def test_parse_header_checks_its_own_length() -> None:
    with pytest.raises(HeaderError, match="header length is 0"):
        parse_header(b"", path="p", file_size=100)
    with pytest.raises(TruncatedFileError, match="runs past the end"):
        parse_header(b"{}", path="p", file_size=9)
    with pytest.raises(HeaderError, match="prefix must be 8 bytes, got 3"):
        header_length(b"\x02\x00\x00", path="p", file_size=100)


# --- files that cannot be read ---------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.safetensors")
    with pytest.raises(SourceError, match="No such file") as info:
        read_header(path)
    assert info.value.path == path
    assert isinstance(info.value.__cause__, OSError)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="is a directory") as info:
        read_header(tmp_path)
    assert info.value.path == str(tmp_path)


def test_path_through_a_file(tmp_path: Path) -> None:
    parent = write(tmp_path, raw({}))
    with pytest.raises(SourceError, match="Not a directory") as info:
        read_header(os.path.join(parent, "child"))
    assert info.value.path == os.path.join(parent, "child")


def test_fifo_is_rejected_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SourceError, match="not a regular file"):
        read_header(fifo)


def test_nul_in_path() -> None:
    with pytest.raises(SourceError, match="cannot open"):
        read_header("bad\0path")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files regardless of permissions")
def test_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path, raw({}))
    os.chmod(path, 0)
    try:
        with pytest.raises(SourceError, match="Permission denied") as info:
            read_header(path)
        assert info.value.path == path
    finally:
        os.chmod(path, 0o600)


def test_no_file_descriptor_leaks(tmp_path: Path) -> None:
    good = write(tmp_path, raw({"w": W}, bytes(8)), "good")
    bad = write(tmp_path, raw(b"{]"), "bad")
    short = write(tmp_path, b"abc", "short")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        read_header(good)
        for p in (bad, short, tmp_path, tmp_path / "missing"):
            with pytest.raises((HeaderError, SourceError)):
                read_header(p)
    assert len(os.listdir("/proc/self/fd")) == before

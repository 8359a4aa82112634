"""Property tests: whatever the bytes, the parser returns a sound header or raises HeaderError.

Besides "never another exception", every accepted header is checked against the invariants the
loader relies on, and against safetensors' own parser in both directions: a file is accepted here
exactly when safetensors accepts it, except where this parser is deliberately stricter
(``STRICTER``) and where safetensors refuses only later, when it builds the torch tensor
(``TORCH_STAGE``: its header parser, used here, does not know torch).
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import deserialize as _deserialize

from streamer.errors import HeaderError
from streamer.format.dtypes import DTYPES
from streamer.format.safetensors import (
    MAX_HEADER_BYTES,
    FileHeader,
    TensorEntry,
    header_length,
    parse_header,
    read_header,
)

# safetensors' own (Rust) parser: [(name, {"dtype", "shape", "data"})], SafetensorError if malformed.
deserialize: Callable[[bytes], list[tuple[str, dict[str, Any]]]] = _deserialize

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)

# Rejections that are deliberate (stricter than safetensors) rather than incompatibilities.
STRICTER = ("appears more than once", "twice")
# What safetensors' header parser accepts and safetensors.torch then refuses to build.
TORCH_STAGE = ("has no torch equivalent", "last dimension must be divisible", "torch cannot represent")

Expected = dict[str, tuple[str, tuple[int, ...], int]]


def assemble(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def parse(content: bytes, path: str = "fuzz.safetensors") -> FileHeader:
    """The pure path a remote source takes: prefix, then header bytes, file size known."""
    n = header_length(content[:8], path=path, file_size=len(content))
    return parse_header(content[8 : 8 + n], path=path, file_size=len(content))


def check_sound(header: FileHeader, content: bytes) -> None:
    """The invariants everything above the format layer relies on."""
    n = struct.unpack("<Q", content[:8])[0]
    assert 0 < n <= MAX_HEADER_BYTES
    assert header.file_size == len(content)
    assert header.data_start == 8 + n <= len(content)
    assert list(header.tensors) == sorted(header.tensors, key=lambda t: (t.begin, t.end, t.name))
    assert len({t.name for t in header.tensors}) == len(header.tensors)
    end_of_previous = header.data_start
    for t in header.tensors:
        assert isinstance(t.name, str)
        t.name.encode("utf-8")
        assert DTYPES[t.dtype.name] is t.dtype
        assert all(type(d) is int and 0 <= d < 2**63 for d in t.shape)
        assert t.begin == end_of_previous, "a gap or an overlap"
        assert t.nbytes == math.prod(t.shape) * t.dtype.itemsize
        assert header.tensor(t.name) is t
        end_of_previous = t.end
    assert end_of_previous == header.file_size, "bytes after the last tensor, or too few"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())


def safetensors_accepts(content: bytes) -> bool:
    try:
        deserialize(content)
    except Exception:
        return False
    return True


def check(content: bytes) -> FileHeader | None:
    """Parse; the only acceptable failure is HeaderError, and we accept exactly what safetensors reads."""
    try:
        header = parse(content)
    except HeaderError as e:
        assert e.path == "fuzz.safetensors"
        if safetensors_accepts(content):
            allowed = STRICTER + TORCH_STAGE
            assert any(s in e.reason for s in allowed), f"safetensors reads this file, we said: {e}"
        return None
    check_sound(header, content)
    assert safetensors_accepts(content), "safetensors refuses a file we accepted"
    return header


def header_bytes_of(dtype: str, shape: list[int]) -> int | None:
    """Bytes a tensor takes, or None where torch (via safetensors) cannot hold it: F4 packs two
    values per byte and its last dimension must be even."""
    dt = DTYPES[dtype]
    if dt.per_item != 1 and (not shape or shape[-1] % dt.per_item):
        return None
    return math.prod(shape) * dt.bits // 8


def valid_shape(dtype: str, shape: list[int]) -> list[int]:
    return shape if header_bytes_of(dtype, shape) is not None else [*shape, 2]


# --- valid files -----------------------------------------------------------------------------

NAMES = st.text(st.characters(codec="utf-8"), max_size=12).filter(lambda s: s != "__metadata__")
SPEC = st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(0, 4), max_size=4))


@st.composite
def valid_files(draw: st.DrawFn) -> tuple[bytes, bytes, Expected]:
    """Header bytes and data of a valid file, and each tensor's (dtype, shape, data-relative offset)."""
    specs = draw(st.dictionaries(NAMES, SPEC, max_size=8))
    doc: dict[str, Any] = {}
    expected = {}
    offset = 0
    for name in draw(st.permutations(sorted(specs))):  # data order independent of name order
        dtype, shape = specs[name]
        shape = valid_shape(dtype, shape)
        size = math.prod(shape) * DTYPES[dtype].bits // 8
        doc[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        torch_shape = [*shape[:-1], shape[-1] // DTYPES[dtype].per_item] if shape else shape
        expected[name] = (dtype, tuple(torch_shape), offset)
        offset += size
    if draw(st.booleans()):
        doc["__metadata__"] = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    text = json.dumps(dict(draw(st.permutations(list(doc.items())))), ensure_ascii=draw(st.booleans()))
    # safetensors pads with spaces after the JSON; JSON whitespace before it is legal too
    padding = st.text(st.sampled_from(" \t\r\n"), max_size=7).map(str.encode)
    header = draw(padding) + text.encode() + draw(padding)
    data = draw(st.binary(min_size=offset, max_size=offset))
    return header, data, expected


@FUZZ
@given(valid_files())
def test_valid_files_parse_exactly(case: tuple[bytes, bytes, Expected]) -> None:
    header_bytes, data, expected = case
    header = check(assemble(header_bytes, data))
    assert header is not None
    got = {t.name: (t.dtype.name, t.shape, t.begin - header.data_start) for t in header.tensors}
    assert got == expected


@FUZZ
@given(valid_files())
def test_valid_files_agree_with_safetensors(case: tuple[bytes, bytes, Expected]) -> None:
    content = assemble(case[0], case[1])
    header = check(content)
    assert header is not None
    theirs = {name: (info["dtype"], info["shape"]) for name, info in deserialize(content)}
    assert theirs == {t.name: (t.dtype.name, header_shape(t)) for t in header.tensors}


def header_shape(t: TensorEntry) -> list[int]:
    """The shape as the header writes it: F4's torch shape counts pairs of values."""
    per_item = t.dtype.per_item
    return [*t.shape[:-1], t.shape[-1] * per_item] if per_item != 1 else list(t.shape)


# --- layouts: where tensors sit, against a model -----------------------------------------------

Layout = dict[str, tuple[str, list[int], int, int]]
DIM = st.integers(0, 3)
SMALL_SPEC = st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(DIM | DIM | DIM | st.booleans(), max_size=2))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[Layout, int]:
    """Valid-looking entries placed mostly one after another, else anywhere: overlaps, holes, sizes
    off by one, spans past either end, a data section that is too long or too short."""
    layout = {}
    previous_end = 0
    for name, (dtype, shape) in draw(st.dictionaries(NAMES, SMALL_SPEC, max_size=6)).items():
        anywhere = st.one_of(st.integers(0, 48), st.just(-1))
        begin = draw(st.one_of(st.just(previous_end), st.just(previous_end), st.just(previous_end), anywhere))
        size = math.prod(shape) * DTYPES[dtype].bits // 8
        end = begin + size + draw(st.sampled_from([0, 0, 0, 0, 0, -1, 1]))
        layout[name] = (dtype, shape, begin, end)
        previous_end = max(previous_end, end)
    data_size = draw(
        st.sampled_from([previous_end] * 3 + [previous_end - 1, previous_end + 1]) | st.integers(0, 64)
    )
    return layout, max(0, data_size)


def model_accepts(layout: Layout, data_size: int) -> bool:
    """The format's rules, written as plainly as possible (pairwise, no sorting): the spans are
    disjoint and fill the data section, and a zero-size tensor sits at 0 or where another ends."""
    spans = []
    for dtype, shape, begin, end in layout.values():
        if any(isinstance(d, bool) for d in shape):  # JSON true is not the integer 1
            return False
        if not 0 <= begin <= end <= data_size or header_bytes_of(dtype, shape) != end - begin:
            return False
        if math.prod(shape) * DTYPES[dtype].bits % 8:
            return False
        spans.append((begin, end))
    full = [(b, e) for b, e in spans if e > b]
    disjoint = all(b1 >= e2 or b2 >= e1 for i, (b1, e1) in enumerate(full) for b2, e2 in full[i + 1 :])
    ends = {0} | {e for _, e in full}
    return (
        disjoint and sum(e - b for b, e in full) == data_size and all(b in ends for b, e in spans if e == b)
    )


@FUZZ
@given(layouts())
def test_layouts_match_model(case: tuple[Layout, int]) -> None:
    layout, data_size = case
    doc = {name: {"dtype": d, "shape": s, "data_offsets": [b, e]} for name, (d, s, b, e) in layout.items()}
    header = check(assemble(json.dumps(doc).encode(), bytes(data_size)))
    assert (header is not None) == model_accepts(layout, data_size)
    if header is not None:
        start = header.data_start
        got = {
            t.name: (t.dtype.name, header_shape(t), t.begin - start, t.end - start) for t in header.tensors
        }
        assert got == layout


# --- byte-level mutations --------------------------------------------------------------------

TOKENS = [b'"', b"{", b"}", b"[", b"]", b",", b":", b"-1", b"0", b"1e3", b"true", b"null", b"\\u0000"]
TOKENS += [b'"__metadata__"', b'"dtype"', b'"shape"', b'"data_offsets"', b"99999999999999999999"]

# (kind, position, argument). Edits of the header keep the length prefix in step (so they reach
# the JSON and the layout checks); edits of the whole file, applied after, do not.
HEADER_EDIT = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 2**16), st.binary(min_size=1, max_size=2)),
    st.tuples(st.just("insert"), st.integers(0, 2**16), st.sampled_from(TOKENS)),
    st.tuples(st.just("delete"), st.integers(0, 2**16), st.integers(1, 8)),
    st.tuples(st.just("digit"), st.integers(0, 2**16), st.sampled_from(b"0123456789")),
)
FILE_EDIT = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 2**16), st.binary(min_size=1, max_size=2)),
    st.tuples(st.just("delete"), st.integers(0, 2**16), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, 2**16), st.none()),
    st.tuples(st.just("length"), st.integers(-8, 8), st.none()),
    st.tuples(st.just("set length"), st.integers(0, 2**64 - 1), st.none()),
)


def edit(content: bytes, mutation: tuple[str, int, Any]) -> bytes:
    kind, where, arg = mutation
    data = bytearray(content)
    i = where % (len(data) + 1)
    if kind == "flip" and i < len(data):
        data[i] ^= arg
    elif kind == "digit":  # replace the digit nearest after i: shifts offsets and shapes
        j = next((k for k in range(i, len(data)) if chr(data[k]).isdigit()), None)
        if j is not None:
            data[j] = arg
    elif kind == "insert":
        data[i:i] = arg
    elif kind == "delete":
        del data[i : i + arg]
    elif kind == "truncate":
        del data[i:]
    elif kind == "length" and len(data) >= 8:
        data[:8] = struct.pack("<Q", max(0, struct.unpack("<Q", data[:8])[0] + where))
    elif kind == "set length" and len(data) >= 8:
        data[:8] = struct.pack("<Q", where)
    return bytes(data)


@FUZZ
@given(valid_files(), st.lists(HEADER_EDIT, max_size=3), st.lists(FILE_EDIT, max_size=2))
def test_mutated_files(
    case: tuple[bytes, bytes, Expected],
    header_edits: list[tuple[str, int, Any]],
    file_edits: list[tuple[str, int, Any]],
) -> None:
    header, data, _ = case
    for mutation in header_edits:
        header = edit(header, mutation)
    content = assemble(header, data)
    for mutation in file_edits:
        content = edit(content, mutation)
    check(content)


# --- well-formed JSON, wrong content ---------------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 64),
    st.integers(-(2**70), 2**70),
    st.integers(10**99, 10**101),  # around the parser's digit cap
    st.floats(allow_nan=True, allow_infinity=True),  # json.dumps writes NaN/Infinity as bare tokens
    st.text(max_size=6),
    st.sampled_from([*sorted(DTYPES), "F4", "F6_E2M3", "f32", ""]),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=8,
)
BAD_SHAPES = st.lists(
    st.one_of(st.integers(-2, 3), st.booleans(), st.floats(0, 3), st.just(2**64)), max_size=3
)
BAD_OFFSETS = st.lists(st.one_of(st.integers(-(2**65), 2**65), st.integers(0, 64), st.booleans()), max_size=3)
JUNK = {"dtype": SCALARS, "shape": BAD_SHAPES | JSON, "data_offsets": BAD_OFFSETS | JSON}
NAME = st.text(min_size=1, max_size=4)
KEYS = st.one_of(NAME, NAME, NAME, NAME, st.sampled_from(["__metadata__", "", "__x__", "\udc00"]))
SLIPS = [0, 0, 0, 0, 1, 2, -1, -4]  # how a tensor's begin strays from the end of the previous one


@st.composite
def junk_headers(draw: st.DrawFn) -> tuple[str, int]:
    """Header text whose entries start out valid, then may get one field replaced, dropped or added."""
    doc: dict[str, Any] = {}
    end = 0
    for name in draw(st.lists(KEYS, unique=True, max_size=6)):
        dtype, shape = draw(SPEC)
        size = math.prod(shape) * DTYPES[dtype].bits // 8
        begin = max(0, end + draw(st.sampled_from(SLIPS)))
        value: Any = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + size]}
        end = begin + size
        damage = draw(
            st.sampled_from(["none", "none", "none", "resize", "replace", "drop", "extra", "whole"])
        )
        if damage == "resize":
            value["data_offsets"][1] += draw(st.sampled_from([-2, -1, 1, 2, 4]))
        elif damage == "replace":
            field = draw(st.sampled_from(sorted(JUNK)))
            value[field] = draw(JUNK[field])
        elif damage == "drop":
            del value[draw(st.sampled_from(sorted(value)))]
        elif damage == "extra":
            value[draw(st.text(max_size=4))] = draw(JSON)
        elif damage == "whole":
            value = draw(JSON)
        doc[name] = value
    if draw(st.booleans()):
        doc["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=3), st.text(max_size=3) | JSON, max_size=3)
        )
    text = json.dumps(doc)
    if doc and draw(st.sampled_from([False] * 9 + [True])):  # repeat a key, which json.dumps cannot do
        name = draw(st.sampled_from(sorted(doc)))
        text = text[:-1] + ", " + json.dumps(name) + ": " + json.dumps(doc[name]) + "}"
    data_size = end + draw(st.sampled_from([0, 0, -1, -2, 1, 3]))  # a short file is a classic
    return text, max(0, data_size)


@FUZZ
@given(junk_headers())
def test_junk_entries(case: tuple[str, int]) -> None:
    text, data_size = case
    check(assemble(text.encode("utf-8", "surrogatepass"), bytes(data_size)))


# --- the file path ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(valid_files(), st.lists(FILE_EDIT, max_size=2))
def test_read_header_on_real_files(
    case: tuple[bytes, bytes, Expected], file_edits: list[tuple[str, int, Any]]
) -> None:
    content = assemble(case[0], case[1])
    for mutation in file_edits:
        content = edit(content, mutation)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "f.safetensors")
        with open(path, "wb") as f:
            f.write(content)
        try:
            header = read_header(path)
        except HeaderError as e:
            assert e.path == path
            with pytest.raises(HeaderError):
                parse(content)
        else:
            check_sound(header, content)
            assert header.tensors == parse(content).tensors

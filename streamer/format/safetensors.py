"""Parse and validate safetensors headers.

A safetensors file is an 8-byte little-endian length ``n``, then ``n`` bytes of UTF-8 JSON (the
header), then the data section. The header maps each tensor name to
``{"dtype": ..., "shape": [...], "data_offsets": [begin, end]}`` with offsets relative to the data
section, plus an optional ``"__metadata__": {str: str}``.

The rules are safetensors' own (0.8, ``safetensors.torch.load_file``): the tensors, in the order
of their offsets, must cover the data section exactly (no gap, no overlap, nothing after the last
one), the JSON is read as serde_json reads it (whitespace around it, numbers, nesting depth), and
every dtype safetensors loads into torch is accepted. A rejected file is a ``HeaderError`` naming
the file and, where there is one, the tensor; a file shorter than its header says is a
``TruncatedFileError`` (both a ``HeaderError`` and a ``ReadError``). The one deliberate
difference: a JSON key that appears twice (a tensor name, a metadata key, an entry's field) is
rejected, where safetensors keeps the last one silently or ignores it.
``header_end`` and ``parse_front`` are pure (every storage's headers go through them);
``read_front`` and ``read_range`` are the local file system's reads.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any, NamedTuple

import torch

from streamer.errors import HeaderError, SourceError, TruncatedFileError
from streamer.format.dtypes import DTYPES, NO_TORCH_DTYPE, DType
from streamer.format.impostors import what_it_is
from streamer.records import record

MAX_HEADER_BYTES = 100_000_000  # the same cap safetensors applies
# Tensors one file may declare. Parsing costs ~25 us and ~1 KiB per tensor: a 100 MB header
# naming 1.4 million would take half a minute and a GiB or two. The largest checkpoints we know
# hold ~1k tensors per shard and ~100k in all.
MAX_TENSORS = 1 << 18
PREFIX_BYTES = 8
LOCAL_FRONT_BYTES = 1 << 16  # a local header read starts with this many bytes: one pread for most files
METADATA_KEY = "__metadata__"

_MISSING = object()
_FIELDS = ("dtype", "shape", "data_offsets")
_MAX_INT_CHARS = 400  # an integer this long overflows a float, which serde_json refuses
_MAX_DEPTH = 127  # serde_json's recursion limit: 128 nested arrays/objects are an error
_SURROGATE_ESCAPE = r"\\u[dD][89a-fA-F]"  # the escapes a lone surrogate is written with
_U64 = 2**64  # safetensors reads offsets and dims as u64 and multiplies them without overflow
_TORCH_MAX_DIM = 2**63 - 1  # torch sizes are int64


class TensorEntry(NamedTuple):
    """One tensor of a file; ``begin``/``end`` are absolute byte offsets in the file (end exclusive).

    ``shape`` is the torch tensor's shape, which is the header's except for packed dtypes (``F4``).
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@record
class FileHeader:
    """A validated header: tensors sorted by ``(begin, end)`` (ties by name), covering the data
    section exactly."""

    path: str
    file_size: int
    data_start: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] = field(hash=False)  # a dict: left out so the header stays hashable
    # Whether ``__metadata__`` was an object, even ``{}`` (safetensors' ``metadata()`` is then a dict).
    has_metadata: bool = field(default=False, compare=False)
    _by_name: Mapping[str, TensorEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tensors})

    def tensor(self, name: str) -> TensorEntry:
        """The entry for ``name``; ``SourceError`` if the file has no such tensor."""
        try:
            return self._by_name[name]
        except KeyError:
            raise SourceError(f"no tensor named {name!r} in this file", path=self.path, tensor=name) from None


def header_length(prefix: bytes, *, path: str, file_size: int) -> int:
    """Decode and check the 8-byte length prefix, before anyone reads (or fetches) ``n`` bytes."""
    if file_size < PREFIX_BYTES:
        raise HeaderError(
            f"file is {file_size} bytes, too short for the {PREFIX_BYTES}-byte header length prefix",
            path=path,
        )
    if len(prefix) != PREFIX_BYTES:
        raise HeaderError(f"header length prefix must be {PREFIX_BYTES} bytes, got {len(prefix)}", path=path)
    n = int.from_bytes(prefix, "little")
    _check_length(n, path=path, file_size=file_size)
    return n


def parse_header(header: bytes, *, path: str, file_size: int) -> FileHeader:
    """Validate the ``n`` header bytes that follow the prefix of a ``file_size``-byte file."""
    _check_length(len(header), path=path, file_size=file_size)
    # Each tensor written as an object has one "data_offsets" key: refused before the JSON is read.
    if bytes(header).count(b'"data_offsets"') > MAX_TENSORS:
        raise HeaderError(f"header declares more than {MAX_TENSORS} tensors (the limit per file)", path=path)
    top = _load_json(header, path=path)
    if len(top) - (METADATA_KEY in top) > MAX_TENSORS:
        raise HeaderError(f"header declares more than {MAX_TENSORS} tensors (the limit per file)", path=path)
    if top.repeated is not None:
        where = _as_tensor(top.repeated)
        raise HeaderError(f"{top.repeated!r} appears more than once in the header", path=path, tensor=where)
    data_start = PREFIX_BYTES + len(header)
    metadata: dict[str, str] = {}
    has_metadata = False
    entries = []
    for name, value in top.items():
        if name == METADATA_KEY:
            metadata = _metadata(value, path=path)
            has_metadata = value is not None
        else:
            entries.append(_entry(name, value, path=path, data_start=data_start))
    entries.sort(key=lambda t: (t.begin, t.end, t.name))
    _check_coverage(entries, path=path, data_start=data_start, file_size=file_size)
    return FileHeader(path, file_size, data_start, tuple(entries), metadata, has_metadata)


def header_end(front: bytes, *, path: str, file_size: int) -> int:
    """How many bytes from the start of the file hold its header (the length prefix and the JSON),
    from its first bytes ``front`` (at least the prefix). A file that is not safetensors at all
    but a common impostor (a pickle, a zip, GGUF, an HTML page, a Git LFS pointer) is a
    ``HeaderError`` saying what it is."""
    try:
        return PREFIX_BYTES + header_length(front[:PREFIX_BYTES], path=path, file_size=file_size)
    except HeaderError:
        impostor = what_it_is(front)
        if impostor is None:
            raise
    raise HeaderError(f"not a safetensors file: this is {impostor}", path=path)


def parse_front(data: bytes, *, path: str, file_size: int) -> FileHeader:
    """The header of a file whose first bytes are ``data``: every storage's headers are parsed
    here. ``data`` holds ``header_end`` bytes, or fewer when the file was cut while being read."""
    n = header_end(data, path=path, file_size=file_size) - PREFIX_BYTES
    header = data[PREFIX_BYTES : PREFIX_BYTES + n]
    if len(header) != n:
        raise TruncatedFileError(
            f"file ended after {len(header)} of {n} header bytes (truncated while reading?)", path=path
        )
    return parse_header(header, path=path, file_size=file_size)


def read_front(path: str | os.PathLike[str], nbytes: int) -> tuple[bytes, int]:
    """Up to ``nbytes`` from the start of a local regular file, and its size; ``SourceError`` if it
    cannot be read at all."""
    name = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO must not hang; it is then rejected as not a regular file.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise SourceError(f"cannot open file: {_reason(e)}", path=name) from e
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise SourceError("is a directory, not a safetensors file", path=name)
        if not stat.S_ISREG(info.st_mode):
            raise SourceError("not a regular file", path=name)
        return _pread(fd, min(nbytes, info.st_size), 0), info.st_size
    except OSError as e:
        raise SourceError(f"cannot read file: {_reason(e)}", path=name) from e
    finally:
        os.close(fd)


def read_range(path: str, begin: int, end: int) -> bytes:
    """Bytes ``[begin, end)`` of a local file; shorter only where it ends early."""
    try:
        with open(path, "rb", buffering=0) as file:
            return _pread(file.fileno(), end - begin, begin)
    except OSError as e:
        raise SourceError(f"cannot read file: {_reason(e)}", path=path) from e


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read and validate the header of a local file; ``SourceError`` if it cannot be read at all."""
    name = os.fspath(path)
    data, size = read_front(name, LOCAL_FRONT_BYTES)
    end = header_end(data, path=name, file_size=size)
    if len(data) < end:
        data += read_range(name, len(data), end)
    return parse_front(data, path=name, file_size=size)


# --- helpers ---------------------------------------------------------------------------------


class _Object(dict[str, Any]):
    """A JSON object that remembers the first key the document repeated.

    ``json`` silently keeps the last value of a repeated key; two tensors with one name (or two
    ``dtype`` fields in one entry) make a file ambiguous, so we want to see the repetition.
    """

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.repeated: str | None = None
        if len(self) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    self.repeated = key
                    break
                seen.add(key)


def _check_length(n: int, *, path: str, file_size: int) -> None:
    if n == 0:
        raise HeaderError("header length is 0 (the smallest header is '{}')", path=path)
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes", path=path)
    if PREFIX_BYTES + n > file_size:
        raise TruncatedFileError(
            f"header length {n} runs past the end of the file ({file_size} bytes, "
            f"at most {file_size - PREFIX_BYTES} header bytes fit)",
            path=path,
        )


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON value")


def _parse_int(literal: str) -> int | float:
    """An integer as serde_json reads it: outside i64/u64 (and ``-0``) it becomes a float, so a
    dimension or offset that large is refused like safetensors refuses it."""
    # int() is quadratic in the digit count: a 100 MB run of digits must fail at once.
    if len(literal) > _MAX_INT_CHARS:
        raise ValueError(f"number literal of {len(literal)} characters is out of range")
    value = int(literal)
    if -(2**63) <= value < _U64 and literal != "-0":
        return value
    return _parse_float(literal)


def _parse_float(literal: str) -> float:
    """serde_json refuses a number that overflows a float; Python would read it as infinity."""
    value = float(literal)  # linear in the length, unlike int()
    if math.isinf(value):
        raise ValueError(f"number {literal[:40]} is out of range")
    return value


def _load_json(header: bytes, *, path: str) -> _Object:
    try:
        text = bytes(header).decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"header is not valid UTF-8 ({e.reason} at byte {e.start})", path=path) from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_Object,
            parse_constant=_reject_constant,
            parse_int=_parse_int,
            parse_float=_parse_float,
        )
    except (ValueError, RecursionError) as e:  # ValueError includes JSONDecodeError
        raise HeaderError(f"header is not valid JSON: {e}", path=path) from None
    if not isinstance(value, _Object):
        raise HeaderError(f"header must be a JSON object, got {_show(value)}", path=path)
    if re.search(_SURROGATE_ESCAPE, text):
        _check_strings(value, path=path)
    return value


def _check_strings(top: _Object, *, path: str) -> None:
    """serde_json refuses an unpaired surrogate escape such as ``"\\ud800"`` in any string, key
    or value; Python's json reads it into a str that cannot be encoded."""
    stack: list[tuple[object, str | None]] = [(top, None)]
    while stack:
        value, tensor = stack.pop()
        if isinstance(value, str):
            if not _is_unicode(value):
                raise HeaderError(
                    "header has a string with an unpaired surrogate escape", path=path, tensor=tensor
                )
        elif isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else ((None, item) for item in value)
            for key, item in items:
                where = _as_tensor(key) if value is top and key is not None else tensor
                if key is not None and not _is_unicode(key):
                    raise HeaderError(
                        "header has a key with an unpaired surrogate escape", path=path, tensor=where
                    )
                stack.append((item, where))


def _nesting(value: object) -> int:
    """How many arrays/objects deep ``value`` is (0 for a scalar)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _metadata(value: object, *, path: str) -> dict[str, str]:
    if value is None:  # safetensors reads `"__metadata__": null` as "no metadata"; so do we
        return {}
    if not isinstance(value, _Object):
        raise HeaderError(f"{METADATA_KEY} must be an object of strings, got {_show(value)}", path=path)
    if value.repeated is not None:
        raise HeaderError(f"{METADATA_KEY} has the key {value.repeated!r} twice", path=path)
    for key, item in value.items():
        if not isinstance(item, str):
            raise HeaderError(f"{METADATA_KEY}[{key!r}] must be a string, got {_show(item)}", path=path)
    return dict(value)


def _entry(name: str, value: object, *, path: str, data_start: int) -> TensorEntry:
    quick = _plain_entry(name, value, data_start)
    if quick is not None:
        return quick

    def fail(message: str) -> HeaderError:
        return HeaderError(message, path=path, tensor=name)

    if isinstance(value, list) and len(value) == len(_FIELDS):
        # serde reads a struct from an array of its fields in order, so safetensors accepts this.
        found = dict(zip(_FIELDS, value, strict=True))
    elif isinstance(value, _Object):
        if value.repeated is not None:
            raise fail(f"entry has the field {value.repeated!r} twice")
        for key, extra in value.items():
            # The header and the entry are 2 levels; the rest of serde_json's depth is the field's.
            if key not in _FIELDS and _nesting(extra) > _MAX_DEPTH - 2:
                raise fail(f"field {key!r} nests arrays/objects deeper than serde_json's {_MAX_DEPTH} levels")
        found = {key: value.get(key, _MISSING) for key in _FIELDS}
    else:
        raise fail(f"entry must be an object with dtype, shape and data_offsets, got {_show(value)}")
    missing = [key for key, item in found.items() if item is _MISSING]
    if missing:
        raise fail(f"entry is missing {', '.join(missing)}")

    dtype_name, shape_value, offsets = found["dtype"], found["shape"], found["data_offsets"]
    if (
        isinstance(dtype_name, _Object)
        and dtype_name.repeated is None
        and list(dtype_name.values()) == [None]
    ):
        (dtype_name,) = dtype_name  # serde also reads the enum value "U8" from {"U8": null}
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        if isinstance(dtype_name, str) and dtype_name in NO_TORCH_DTYPE:
            raise fail(f"dtype {dtype_name} {NO_TORCH_DTYPE[dtype_name]}")
        raise fail(f"unsupported dtype {_show(dtype_name)} (supported: {', '.join(DTYPES)})")
    dtype = DTYPES[dtype_name]

    if not isinstance(shape_value, list):
        raise fail(f"shape must be an array of integers >= 0, got {_show(shape_value)}")
    for i, dim in enumerate(shape_value):
        if not _is_int(dim) or dim < 0:
            raise fail(f"shape[{i}] must be an integer >= 0, got {_show(dim)}")
    shape = tuple(shape_value)

    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) and x >= 0 for x in offsets)):
        raise fail(f"data_offsets must be [begin, end] integers >= 0, got {_show(offsets)}")
    begin, end = offsets
    if begin > end:
        raise fail(f"data_offsets {_show(offsets)} must satisfy begin <= end")

    span = end - begin
    nbits = _element_count(shape, fail=fail) * dtype.bits
    if nbits >= _U64:
        raise fail(f"shape {_show_shape(shape)} of {dtype.name} overflows a 64-bit byte count")
    if nbits % 8:
        raise fail(f"shape {_show_shape(shape)} of {dtype.name} does not end on a byte boundary")
    if nbits // 8 != span:
        raise fail(
            f"shape {_show_shape(shape)} of {dtype.name} needs {nbits // 8} bytes, "
            f"but data_offsets {_show(offsets)} span {span}"
        )
    return TensorEntry(
        name, dtype, _torch_shape(shape, dtype, fail=fail), data_start + begin, data_start + end
    )


def _plain_entry(name: str, value: object, data_start: int) -> TensorEntry | None:
    """The entry of the form safetensors writes (an object of exactly dtype, shape and offsets, a
    one-element-per-item dtype, every dimension positive, sizes that agree), checked in a few
    steps; None for anything else, which ``_entry`` then checks rule by rule (and names the fault).

    With every dimension positive the running product only grows, so ``prod(shape) < 2**63`` is
    also safetensors' u64 rule and torch's size and stride limits."""
    if type(value) is not _Object or value.repeated is not None or len(value) != len(_FIELDS):
        return None
    dtype_name, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if type(dtype_name) is not str or type(shape) is not list or type(offsets) is not list:
        return None
    if len(offsets) != 2:
        return None
    dtype = DTYPES.get(dtype_name)
    begin, end = offsets
    if dtype is None or dtype.per_item != 1 or type(begin) is not int or type(end) is not int:
        return None
    if not 0 <= begin <= end or not all(type(dim) is int and dim > 0 for dim in shape):
        return None
    count = math.prod(shape)
    if count >= _TORCH_MAX_DIM or count * dtype.itemsize != end - begin:
        return None
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _element_count(shape: tuple[int, ...], *, fail: Callable[[str], HeaderError]) -> int:
    """prod(shape) as safetensors computes it: left to right in u64, an overflow is an error even
    if a later dimension is 0 (and so the product stays small however hostile the header)."""
    count = 1
    for dim in shape:
        count *= dim
        if count >= _U64:
            raise fail(f"shape {_show_shape(shape)} overflows a 64-bit element count")
    return count


def _torch_shape(
    shape: tuple[int, ...], dtype: DType, *, fail: Callable[[str], HeaderError]
) -> tuple[int, ...]:
    """The shape of the torch tensor; what torch cannot represent is refused here, not by torch."""
    if any(dim > _TORCH_MAX_DIM for dim in shape):
        raise fail(f"shape {_show_shape(shape)} has a dimension torch cannot represent (over 2**63 - 1)")
    if _exceeds(shape, _TORCH_MAX_DIM):  # so zero elements, but dimensions that strides overflow
        try:  # whether torch's strides overflow: ask torch, the same way the loader builds it
            torch.empty(0, dtype=dtype.torch_dtype).reshape(shape)
        except RuntimeError as e:
            raise fail(f"shape {_show_shape(shape)} is beyond what torch can represent ({e})") from None
    if dtype.per_item == 1:
        return shape
    if not shape or shape[-1] % dtype.per_item:
        raise fail(
            f"shape {_show_shape(shape)} of {dtype.name}: torch's {dtype.torch_dtype} packs {dtype.per_item} "
            f"values per element, so the last dimension must be divisible by {dtype.per_item}"
        )
    return (*shape[:-1], shape[-1] // dtype.per_item)


def _exceeds(shape: tuple[int, ...], limit: int) -> bool:
    """Whether the product of the nonzero dimensions exceeds ``limit`` (stops as soon as it does)."""
    product = 1
    for dim in shape:
        product *= max(dim, 1)
        if product > limit:
            return True
    return False


def _check_coverage(entries: list[TensorEntry], *, path: str, data_start: int, file_size: int) -> None:
    """``entries``, sorted by (begin, end), must tile the data section: each begins where the
    previous one ended (a zero-size tensor too), and the last one ends where the file ends."""

    def offsets(t: TensorEntry) -> str:  # as written in the header, relative to the data section
        return f"data_offsets [{t.begin - data_start}, {t.end - data_start}]"

    previous: TensorEntry | None = None
    for entry in entries:
        expected = data_start if previous is None else previous.end
        if entry.begin != expected:
            after = (
                "the start of the data section"
                if previous is None
                else f"{previous.name!r} ({offsets(previous)})"
            )
            how = (
                "overlaps"
                if entry.begin < expected
                else f"leaves {entry.begin - expected} bytes unclaimed after"
            )
            raise HeaderError(
                f"tensor {entry.name!r} ({offsets(entry)}) {how} {after}", path=path, tensor=entry.name
            )
        previous = entry
    end = data_start if previous is None else previous.end
    last = None if previous is None else previous.name
    if end > file_size:
        raise TruncatedFileError(
            f"the tensors need {end - data_start} data bytes, but the file holds {file_size - data_start} "
            f"(file is {file_size} bytes, data starts at byte {data_start})",
            path=path,
            tensor=last,
        )
    if end < file_size:
        raise HeaderError(
            f"{file_size - end} bytes after the last tensor belong to no tensor "
            f"(data starts at byte {data_start}, the tensors end at byte {end}, file is {file_size} bytes)",
            path=path,
            tensor=last,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not 1


def _is_unicode(text: str) -> bool:
    """False for strings with lone surrogates, which JSON escapes (``"\\ud800"``) can produce."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_tensor(key: str) -> str | None:
    return None if key == METADATA_KEY else key


def _show(value: object) -> str:
    """A short JSON rendering of a header value for messages (a header may be 100 MB)."""
    if isinstance(value, list) and len(value) <= 8 and not any(isinstance(v, (list, dict)) for v in value):
        text = "[" + ", ".join(_show(v) for v in value) + "]"
    elif isinstance(value, list):
        return f"an array of {len(value)} items"
    elif isinstance(value, dict):
        return f"an object with {len(value)} keys"
    else:
        text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _show_shape(shape: tuple[int, ...]) -> str:
    dims = ", ".join(str(d) for d in shape[:8])
    if len(dims) > 60:
        dims = dims[:57] + "..."
    if len(shape) > 8:
        dims += f", ... ({len(shape)} dims)"
    return f"[{dims}]"


def _reason(error: Exception) -> str:
    return error.strerror if isinstance(error, OSError) and error.strerror else str(error)


def _pread(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset``; shorter only at end of file (pread may return less)."""
    chunks = []
    got = 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)

"""Parse and validate safetensors headers.

A safetensors file is an 8-byte little-endian length ``n``, then ``n`` bytes of UTF-8 JSON (the
header), then the data section. The header maps each tensor name to
``{"dtype": ..., "shape": [...], "data_offsets": [begin, end]}`` with offsets relative to the data
section, plus an optional ``"__metadata__": {str: str}``.

Everything here is strict: a header that could make a reader touch bytes outside the file, or
two tensors share bytes, is rejected with a ``HeaderError`` naming the file and the tensor.
``header_length`` and ``parse_header`` are pure (remote sources call them with fetched bytes);
only ``read_header`` touches the file system.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streamer.errors import HeaderError, SourceError
from streamer.format.dtypes import DTYPES, DType

MAX_HEADER_BYTES = 100_000_000  # the same cap safetensors applies
PREFIX_BYTES = 8
METADATA_KEY = "__metadata__"

_MISSING = object()
_MAX_INT_DIGITS = 100


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file; ``begin``/``end`` are absolute byte offsets in the file (end exclusive)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class FileHeader:
    """A validated header: tensors sorted by ``begin`` (ties by name), none overlapping."""

    path: str
    file_size: int
    data_start: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str] = field(hash=False)  # a dict: left out so the header stays hashable
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
    top = _load_json(header, path=path)
    if top.repeated is not None:
        where = _as_tensor(top.repeated)
        raise HeaderError(f"{top.repeated!r} appears more than once in the header", path=path, tensor=where)
    data_start = PREFIX_BYTES + len(header)
    metadata: dict[str, str] = {}
    entries = []
    for name, value in top.items():
        if name == METADATA_KEY:
            metadata = _metadata(value, path=path)
        else:
            entries.append(_entry(name, value, path=path, data_start=data_start, file_size=file_size))
    entries.sort(key=lambda t: (t.begin, t.name))
    _check_no_overlap(entries, path=path, data_start=data_start)
    return FileHeader(path, file_size, data_start, tuple(entries), metadata)


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Read and validate the header of a local file; ``SourceError`` if it cannot be read at all."""
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
        n = header_length(_pread(fd, PREFIX_BYTES, 0), path=name, file_size=info.st_size)
        header = _pread(fd, n, PREFIX_BYTES)
    except OSError as e:
        raise SourceError(f"cannot read file: {_reason(e)}", path=name) from e
    finally:
        os.close(fd)
    if len(header) != n:
        raise HeaderError(
            f"file ended after {len(header)} of {n} header bytes (truncated while reading?)", path=name
        )
    return parse_header(header, path=name, file_size=info.st_size)


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
        raise HeaderError(
            f"header length {n} runs past the end of the file ({file_size} bytes, "
            f"at most {file_size - PREFIX_BYTES} header bytes fit)",
            path=path,
        )


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON value")


def _parse_int(literal: str) -> int:
    # Every real offset or dimension fits in 20 digits, and int() is quadratic in the digit count:
    # a 100 MB run of digits must be an error, not a minutes-long stall.
    if len(literal) > _MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(literal)} characters is too large")
    return int(literal)


def _load_json(header: bytes, *, path: str) -> _Object:
    try:
        text = bytes(header).decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"header is not valid UTF-8 ({e.reason} at byte {e.start})", path=path) from None
    if not text.startswith("{"):  # the safetensors rule; also rules out a BOM or leading whitespace
        raise HeaderError(f"header must start with '{{', starts with {text[:16]!r}", path=path)
    try:
        value = json.loads(
            text, object_pairs_hook=_Object, parse_constant=_reject_constant, parse_int=_parse_int
        )
    except (ValueError, RecursionError) as e:  # ValueError includes JSONDecodeError
        raise HeaderError(f"header is not valid JSON: {e}", path=path) from None
    if not isinstance(value, _Object):  # unreachable after the '{' check, kept for the type checker
        raise HeaderError(f"header must be a JSON object, got {_show(value)}", path=path)
    return value


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
        if not (_is_unicode(key) and _is_unicode(item)):
            raise HeaderError(f"{METADATA_KEY}[{key!r}] contains an unpaired surrogate escape", path=path)
    return dict(value)


def _entry(name: str, value: object, *, path: str, data_start: int, file_size: int) -> TensorEntry:
    def fail(message: str) -> HeaderError:
        return HeaderError(message, path=path, tensor=name)

    if not name:
        raise fail("tensor name is empty")
    if not _is_unicode(name):
        raise fail("tensor name contains an unpaired surrogate escape")
    if not isinstance(value, _Object):
        raise fail(f"entry must be an object with dtype, shape and data_offsets, got {_show(value)}")
    if value.repeated is not None:
        raise fail(f"entry has the field {value.repeated!r} twice")
    found = {key: value.get(key, _MISSING) for key in ("dtype", "shape", "data_offsets")}
    missing = [key for key, item in found.items() if item is _MISSING]
    if missing:
        raise fail(f"entry is missing {', '.join(missing)}")

    dtype_name, shape_value, offsets = found["dtype"], found["shape"], found["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise fail(f"unsupported dtype {_show(dtype_name)} (supported: {', '.join(DTYPES)})")
    dtype = DTYPES[dtype_name]

    if not isinstance(shape_value, list):
        raise fail(f"shape must be an array of integers >= 0, got {_show(shape_value)}")
    for i, dim in enumerate(shape_value):
        if not _is_int(dim) or dim < 0:
            raise fail(f"shape[{i}] must be an integer >= 0, got {_show(dim)}")
    shape = tuple(shape_value)

    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
        raise fail(f"data_offsets must be [begin, end] integers, got {_show(offsets)}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise fail(f"data_offsets {_show(offsets)} must satisfy 0 <= begin <= end")
    if end > file_size - data_start:
        raise fail(
            f"data_offsets {_show(offsets)} reach past the end of the file "
            f"(data starts at byte {data_start}, file is {file_size} bytes)"
        )

    span = end - begin
    count = _element_count(shape, limit=span)
    if count * dtype.itemsize != span:
        needs = f"more than {span}" if count > span else str(count * dtype.itemsize)
        raise fail(
            f"shape {_show_shape(shape)} of {dtype.name} needs {needs} bytes ({dtype.itemsize} per element), "
            f"but data_offsets {_show(offsets)} span {span}"
        )
    return TensorEntry(name, dtype, shape, data_start + begin, data_start + end)


def _check_no_overlap(entries: list[TensorEntry], *, path: str, data_start: int) -> None:
    """``entries`` are sorted by begin; a zero-size tensor holds no bytes, so it overlaps nothing."""

    def offsets(t: TensorEntry) -> str:  # as written in the header, relative to the data section
        return f"data_offsets [{t.begin - data_start}, {t.end - data_start}]"

    previous: TensorEntry | None = None
    for entry in entries:
        if entry.nbytes == 0:
            continue
        if previous is not None and entry.begin < previous.end:
            raise HeaderError(
                f"tensors {previous.name!r} ({offsets(previous)}) and "
                f"{entry.name!r} ({offsets(entry)}) overlap",
                path=path,
                tensor=entry.name,
            )
        previous = entry


def _element_count(shape: tuple[int, ...], *, limit: int) -> int:
    """prod(shape), capped at ``limit + 1``: a hostile header can make the true product enormous."""
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > limit:
            return limit + 1
    return count


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

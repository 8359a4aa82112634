"""Local sources: one file, a list of files, a directory, or an HF index file."""

from __future__ import annotations

import json
import os
import posixpath
import re
import stat
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path

from streamer.errors import MissingFileError, SourceError, SourceTypeError, StreamerError, listed
from streamer.records import record

SourceLike = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
PathArg = str | bytes | os.PathLike[str] | os.PathLike[bytes]
SourceArg = PathArg | Sequence[PathArg]
"""What the API takes as a source: a path or URI (``str``, ``bytes`` or ``os.PathLike``, as
``open()`` takes), or a sequence of them."""

INDEX_SUFFIX = ".index.json"
SAFETENSORS_INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 100_000_000  # as safetensors caps a header; real indexes are ~10 MB at most
MAX_INDEX_ENTRIES = 1 << 21
_URI = r"([a-zA-Z][a-zA-Z0-9+.-]*)://"


@record
class ResolvedSource:
    """The files to read, in checkpoint order, and the index's tensor→file map if one was given."""

    paths: tuple[str, ...]
    weight_map: dict[str, str] = field(default_factory=dict)
    index_path: str | None = None


def as_source(source: object) -> str | list[str]:
    """``source`` (a ``SourceArg``) as text: a path or URI, or a list of them; anything else is a
    ``SourceTypeError`` saying what was passed."""
    if isinstance(source, (str, bytes, os.PathLike)):
        return _path_text(source, "source")
    if isinstance(source, Sequence):
        return [_path_text(item, f"source[{number}]") for number, item in enumerate(source)]
    raise SourceTypeError(
        f"a source is a path or URI (str, bytes or os.PathLike) or a list of them, got {_kind(source)}"
    )


def _path_text(item: object, what: str) -> str:
    if isinstance(item, os.PathLike):
        item = os.fspath(item)
    if isinstance(item, bytes):
        return os.fsdecode(item)
    if isinstance(item, str):
        return item
    raise SourceTypeError(f"{what} must be a path or URI (str, bytes or os.PathLike), got {_kind(item)}")


def _kind(value: object) -> str:
    shown = repr(value)
    return f"{type(value).__name__} {shown if len(shown) <= 60 else shown[:57] + '...'}"


def source_texts(source: SourceLike) -> list[str]:
    """The paths or URIs a source names: itself, or each item of a list."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    return [os.fspath(item) for item in items]


def resolve(source: SourceLike) -> ResolvedSource:
    """Turns a user's source into files; nothing is read but directory listings and the index."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if uri_scheme(text) is not None:  # streamer.backends sends URIs to their own storage
            raise StreamerError("a URI reached local file resolution", path=text)
        path = Path(text)
        if path.is_dir():
            return _resolve_directory(path)
        if text.endswith(INDEX_SUFFIX):
            return _resolve_index(path)
        return ResolvedSource(paths=(_existing_file(path, directory=text.endswith(("/", os.sep))),))
    paths = [os.fspath(p) for p in source]
    if not paths:
        raise SourceError("the list of checkpoint files is empty")
    if len(set(paths)) != len(paths):
        raise SourceError("the list of checkpoint files names a file twice")
    return ResolvedSource(paths=tuple(_existing_file(Path(p), directory=False) for p in paths))


def uri_scheme(text: str) -> str | None:
    """The scheme of ``text`` if it is a URI (``s3://...``), None for a local path."""
    match = re.match(_URI, text)
    return match.group(1) if match else None


def _existing_file(path: Path, *, directory: bool) -> str:
    """``path``, a regular file; ``directory``: the user named a directory (a trailing slash)."""
    if not path.exists():
        # A checkpoint's files have a suffix; a name without one (or with a slash) is a directory.
        if directory or not path.suffix:
            missing = "no such directory"
        elif path.suffix in (".safetensors", ".json"):
            missing = "no such file"
        else:
            missing = "no such file or directory"
        raise MissingFileError(missing, path=str(path))
    if not path.is_file():
        raise SourceError("not a regular file", path=str(path))
    return str(path)


def _resolve_directory(directory: Path) -> ResolvedSource:
    """A directory's index, where it holds one (the source of truth, as for Hugging Face and vLLM:
    exactly its shards are read, other safetensors files beside them are ignored); else every
    ``*.safetensors`` file in it."""
    index = _directory_index(directory)
    if index is not None:
        return _resolve_index(index)
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise SourceError("the directory holds no *.safetensors file", path=str(directory))
    return ResolvedSource(paths=tuple(str(p) for p in files))


def _directory_index(directory: Path) -> Path | None:
    """The directory's index file: ``model.safetensors.index.json``, else its only
    ``*.safetensors.index.json``; several others and none of that name is ambiguous."""
    names = [p.name for p in directory.glob(f"*{SAFETENSORS_INDEX_SUFFIX}") if p.is_file()]
    chosen = choose_index(names, where=str(directory))
    return None if chosen is None else directory / chosen


def _resolve_index(index_path: Path) -> ResolvedSource:
    """Reads ``model.safetensors.index.json``; every shard it names must exist before any read."""
    try:
        # O_NONBLOCK: opening a FIFO must not hang; it is then refused as not a regular file.
        fd = os.open(index_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MissingFileError("no such index file", path=str(index_path)) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise SourceError(f"cannot read the index: {exc}", path=str(index_path)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceError("the index is not a regular file", path=str(index_path))
        with os.fdopen(os.dup(fd), "rb") as file:
            text = file.read(MAX_INDEX_BYTES + 1)
    except OSError as exc:
        raise SourceError(f"cannot read the index: {exc}", path=str(index_path)) from None
    finally:
        os.close(fd)
    weight_map = parse_index(text, path=str(index_path))
    shards = sorted(set(weight_map.values()))
    directory = index_path.parent
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise MissingFileError(
            f"the index names {len(missing)} shard(s) that are not there: {listed(missing, quoted=False)}",
            path=str(index_path),
        )
    return ResolvedSource(
        paths=tuple(str(directory / s) for s in shards),
        weight_map={name: str(directory / shard) for name, shard in weight_map.items()},
        index_path=str(index_path),
    )


def choose_index(names: Sequence[str], *, where: str) -> str | None:
    """Of the index files ``names`` in one directory or prefix: the one to read, None when there is
    none."""
    if DEFAULT_INDEX in names:
        return DEFAULT_INDEX
    if len(names) <= 1:
        return next(iter(names), None)
    raise SourceError(
        f"several index files ({', '.join(sorted(names))}) and none named {DEFAULT_INDEX}: "
        "name the one to load",
        path=where,
    )


def parse_index(text: bytes, *, path: str) -> dict[str, str]:
    """The tensor name -> shard file name map of an index document (local or remote).

    An index is data from whoever published the checkpoint: it is at most ``MAX_INDEX_BYTES``,
    names at most ``MAX_INDEX_ENTRIES`` tensors, and each shard it names must lie, taken
    lexically, in the index's own directory or below it (symlinks are not resolved: the Hugging
    Face cache keeps shards as links into ``../../blobs/``)."""
    if len(text) > MAX_INDEX_BYTES:
        raise SourceError(f"the index is larger than {MAX_INDEX_BYTES} bytes (the limit)", path=path)
    try:
        document = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"cannot read the index: {exc}", path=path) from None
    except RecursionError:
        raise SourceError("cannot read the index: its JSON nests too deep", path=path) from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SourceError("the index has no 'weight_map' of tensor name -> file name", path=path)
    if not weight_map:
        raise SourceError("the index's weight_map is empty", path=path)
    if len(weight_map) > MAX_INDEX_ENTRIES:
        raise SourceError(f"the index names more than {MAX_INDEX_ENTRIES} tensors (the limit)", path=path)
    for name, shard in weight_map.items():
        if not inside_directory(shard):
            raise SourceError(
                f"the index places this tensor in {shard!r}, outside the index's directory",
                path=path,
                tensor=name,
            )
    return weight_map


def inside_directory(relative: str) -> bool:
    """Whether ``relative`` names a file in a directory or below it, lexically: not absolute, no
    ``..`` that climbs out, not the directory itself, no NUL."""
    if not relative or "\0" in relative or relative.startswith("/"):
        return False
    normal = posixpath.normpath(relative)
    return normal not in (".", "..") and not normal.startswith("../")

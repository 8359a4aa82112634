"""Local sources: one file, a list of files, a directory, or an HF index file."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from streamer.errors import MissingFileError, SourceError, StreamerError

SourceLike = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

INDEX_SUFFIX = ".index.json"
_URI = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://")


@dataclass(frozen=True)
class ResolvedSource:
    """The files to read, in checkpoint order, and the index's tensor→file map if one was given."""

    paths: tuple[str, ...]
    weight_map: dict[str, str] = field(default_factory=dict)
    index_path: str | None = None


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
        return ResolvedSource(paths=(_existing_file(path),))
    paths = [os.fspath(p) for p in source]
    if not paths:
        raise SourceError("the list of checkpoint files is empty")
    if len(set(paths)) != len(paths):
        raise SourceError("the list of checkpoint files names a file twice")
    return ResolvedSource(paths=tuple(_existing_file(Path(p)) for p in paths))


def uri_scheme(text: str) -> str | None:
    """The scheme of ``text`` if it is a URI (``s3://...``), None for a local path."""
    match = _URI.match(text)
    return match.group(1) if match else None


def _existing_file(path: Path) -> str:
    if not path.exists():
        raise MissingFileError("no such file", path=str(path))
    if not path.is_file():
        raise SourceError("not a regular file", path=str(path))
    return str(path)


def _resolve_directory(directory: Path) -> ResolvedSource:
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise SourceError("the directory holds no *.safetensors file", path=str(directory))
    return ResolvedSource(paths=tuple(str(p) for p in files))


def _resolve_index(index_path: Path) -> ResolvedSource:
    """Reads ``model.safetensors.index.json``; every shard it names must exist before any read."""
    try:
        text = index_path.read_bytes()
    except FileNotFoundError:
        raise MissingFileError("no such index file", path=str(index_path)) from None
    except OSError as exc:
        raise SourceError(f"cannot read the index: {exc}", path=str(index_path)) from None
    weight_map = parse_index(text, path=str(index_path))
    shards = sorted(set(weight_map.values()))
    directory = index_path.parent
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise SourceError(f"the index references missing shards: {', '.join(missing)}", path=str(index_path))
    return ResolvedSource(
        paths=tuple(str(directory / s) for s in shards),
        weight_map={name: str(directory / shard) for name, shard in weight_map.items()},
        index_path=str(index_path),
    )


def parse_index(text: bytes, *, path: str) -> dict[str, str]:
    """The tensor name -> shard file name map of an index document (local or remote)."""
    try:
        document = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"cannot read the index: {exc}", path=path) from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise SourceError("the index has no 'weight_map' of tensor name -> file name", path=path)
    if not weight_map:
        raise SourceError("the index's weight_map is empty", path=path)
    return weight_map

"""What an object store's source resolved to last time, kept in the cache directory: the
provisional open.

A hit needs no byte from the store, but the open (the listing, a header GET per file) still costs
round trips before the first block could be read. A note lets the load start from what the
source was last time while the store is asked in the background: its files (bucket, key, size,
version: an ETag or a generation) and each file's whole header. Nothing read from it counts
before the store answers the same (``CachedObjectStorage``, ``CacheFeed``).

Layout: ``<dir>/opens/<key>.note``, ``key`` a hash of the endpoint and the source's text. A note
is magic, the xxh3_64 of the rest, the length of a JSON description (which names the endpoint and
source again), the description, and the headers back to back; written under a temporary name
renamed into place (those of processes that died mid-write are removed at the next write). A note
that is torn, foreign (another source's, copied or renamed) or unreadable is no note: the open
goes to the store as without one, and notes what it answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from streamer.backends.base import Front, Opened
from streamer.backends.cache.store import hashed_name, writer_alive
from streamer.backends.http.objects import StoredObject
from streamer.backends.sources import ResolvedSource
from streamer.errors import StreamerError
from streamer.format.safetensors import header_end
from streamer.host.safedir import Access

NOTES_DIR = "opens"
_MAGIC = b"STRMOP03"
_HEAD = struct.Struct("<8sQQ")  # magic, xxh3_64 of everything after the head, JSON length
_TMP = ".tmp."
_MAX_BYTES = 64 << 20  # larger notes are neither written nor read (a note is read whole)


@dataclass(frozen=True)
class NoteOf:
    """What a note is of: a source given as ``texts`` (one URI, or a list of object URIs) at
    ``endpoint`` (the store's place: ``ObjectStorage.place``)."""

    endpoint: str | None
    texts: tuple[str, ...]

    @property
    def key(self) -> str:
        """The note's file name."""
        return hashed_name(self.endpoint or "", *self.texts)


StoredOf = Callable[[str, str, int, "str | None"], StoredObject]  # (bucket, key, size, version)


class OpenNotes:
    """The notes in ``<root>/opens`` (made with ``access``), of objects ``stored`` makes; every
    failure to read or write one is silent (no note)."""

    def __init__(self, root: str, access: Access, stored: StoredOf) -> None:
        self._dir = os.path.join(root, NOTES_DIR)
        self._access = access
        self._stored = stored

    def read(self, of: NoteOf) -> Opened | None:
        try:
            with open(os.path.join(self._dir, f"{of.key}.note"), "rb") as file:
                data = file.read(_MAX_BYTES + 1)
        except OSError:
            return None
        return _decode(data, of, self._stored) if len(data) <= _MAX_BYTES else None

    def write(self, of: NoteOf, opened: Opened) -> None:
        """Notes ``opened``, if every front holds its file's whole header (else there is no note:
        a provisional open must need nothing more from the store to be parsed)."""
        data = _encode(opened, of)
        if data is None or len(data) > _MAX_BYTES:
            return
        path = os.path.join(self._dir, f"{of.key}.note")
        temporary = f"{path}{_TMP}{os.getpid()}.{threading.get_ident()}"
        try:
            self._access.make(self._dir)
            with os.fdopen(self._access.create(temporary, os.O_WRONLY | os.O_TRUNC), "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        self._clean()

    def _clean(self) -> None:
        """Removes the temporary notes of processes that no longer run (``kill -9`` mid-write)."""
        with contextlib.suppress(OSError), os.scandir(self._dir) as entries:
            for entry in entries:
                if _TMP in entry.name and not writer_alive(entry.name):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)


def _encode(opened: Opened, of: NoteOf) -> bytes | None:
    headers = []
    files = []
    for front in opened.fronts:
        info = front.file
        if not isinstance(info, StoredObject):
            return None
        try:
            end = header_end(front.data, path=info.path, file_size=info.size)
        except StreamerError:
            return None
        if len(front.data) < end:
            return None
        headers.append(front.data[:end])
        files.append(
            {"bucket": info.uri.bucket, "key": info.uri.key, "size": info.size, "version": info.version}
        )
    source = opened.source
    description = json.dumps(
        {
            "endpoint": of.endpoint,
            "texts": list(of.texts),
            "paths": list(source.paths),
            "weight_map": source.weight_map,
            "index_path": source.index_path,
            "files": files,
            "header_lengths": [len(h) for h in headers],
        }
    ).encode()
    body = description + b"".join(headers)
    return _HEAD.pack(_MAGIC, xxhash.xxh3_64_intdigest(body), len(description)) + body


def _decode(data: bytes, of: NoteOf, stored: StoredOf) -> Opened | None:
    if len(data) < _HEAD.size:
        return None
    magic, digest, length = _HEAD.unpack_from(data)
    body = data[_HEAD.size :]
    if magic != _MAGIC or length > len(body) or xxhash.xxh3_64_intdigest(body) != digest:
        return None
    try:
        description = json.loads(body[:length])
        if description["endpoint"] != of.endpoint or description["texts"] != list(of.texts):
            return None  # another source's note, under this one's name
        fronts = []
        position = length
        for file, header_length in zip(description["files"], description["header_lengths"], strict=True):
            version = file["version"]
            if version is not None and not isinstance(version, str):
                return None
            info = stored(str(file["bucket"]), str(file["key"]), int(file["size"]), version)
            fronts.append(Front(info, body[position : position + int(header_length)]))
            position += int(header_length)
        source = ResolvedSource(
            paths=tuple(str(p) for p in description["paths"]),
            weight_map={str(k): str(v) for k, v in description["weight_map"].items()},
            index_path=description["index_path"],
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if position != len(body):
        return None
    return Opened(source, tuple(fronts))

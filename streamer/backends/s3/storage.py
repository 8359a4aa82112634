"""S3 as a storage: ``s3://bucket/key.safetensors``, ``s3://bucket/prefix/`` and
``s3://bucket/.../*.index.json``.

Opening lists the prefix or reads the index, then fetches the front of every file, all files at
once, each with one speculative ranged GET of the first ``header_bytes`` (which also gives the
object's size and ETag); ``read_ranges`` fetches the rest of a header longer than that. The one
client (``client.py``) is made on first use and serves every run of the handle (``backends/http/feeder.py``)
until ``close()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from streamer.backends.base import (
    Delivery,
    Extent,
    Feed,
    FileIdentity,
    Front,
    Named,
    Opened,
    Range,
    Storage,
    StoredFile,
)
from streamer.backends.http.feeder import ObjectFeeder
from streamer.backends.s3.client import ClientHolder, S3Client
from streamer.backends.s3.uri import ObjectInfo, S3Uri, parse_uri
from streamer.backends.sources import (
    INDEX_SUFFIX,
    MAX_INDEX_BYTES,
    SAFETENSORS_INDEX_SUFFIX,
    ResolvedSource,
    SourceLike,
    choose_index,
    parse_index,
    source_texts,
)
from streamer.config import S3Config
from streamer.engine import native
from streamer.errors import S3MissingError, S3SourceError, SourceError, StreamerError, listed

_SUFFIX = ".safetensors"
_HEADER_REQUESTS = 32  # header GETs in flight at once


class S3Storage(Storage):
    """An S3 endpoint as ``config`` describes it; one client, shared by the handle's runs."""

    delivery = Delivery.ONE_RECEIVER  # the client's event loop thread receives every byte

    def __init__(self, config: S3Config) -> None:
        self._holder = ClientHolder(config)

    def open(self, source: SourceLike) -> Opened:
        uris = [parse_uri(text) for text in source_texts(source)]
        client = self._holder.get()
        return client.call(_open(client, uris, single=len(uris) == 1))

    def read_ranges(self, ranges: Sequence[Range]) -> list[bytes]:
        if not ranges:
            return []
        client = self._holder.get()
        return client.call(
            _read_ranges(client, [(s3_object(file), begin, end) for file, begin, end in ranges])
        )

    def identify(self, files: Sequence[StoredFile], *, full: bool) -> list[FileIdentity]:
        """The ETag of each object, as its header read saw it: every later GET is pinned to it
        (``If-Match``), so it names the bytes read, whole."""
        return [FileIdentity(content=s3_object(file).etag or "") for file in files]

    def feed(
        self, engine: native.Engine, files: Sequence[StoredFile], spans: Sequence[Extent], tensors: Named
    ) -> Feed:
        return ObjectFeeder(self._holder.get(), engine, [s3_object(file) for file in files])

    @property
    def config(self) -> S3Config:
        return self._holder.config

    def client(self) -> S3Client:
        """The session's client (made on first use), for a storage that wraps this one (the cache)."""
        return self._holder.get()

    def close(self) -> None:
        self._holder.close()


def s3_object(file: StoredFile) -> ObjectInfo:
    if not isinstance(file, ObjectInfo):
        raise StreamerError("not an S3 object", path=file.path)  # a bug: files come from this storage
    return file


async def _read_ranges(client: S3Client, ranges: list[tuple[ObjectInfo, int, int]]) -> list[bytes]:
    gate = asyncio.Semaphore(_HEADER_REQUESTS)

    async def read(info: ObjectInfo, begin: int, end: int) -> bytes:
        async with gate:
            return await client.get_bytes(info, begin, end, source_errors=True)

    return list(await asyncio.gather(*(read(*r) for r in ranges)))


async def _open(client: S3Client, uris: list[S3Uri], *, single: bool) -> Opened:
    index_path: str | None = None
    weight_map: dict[str, str] = {}
    if single and (uris[0].key == "" or uris[0].key.endswith("/")):
        files, index = await _list_prefix(client, uris[0])
        if index is not None:
            return await _open(client, [index], single=True)
    elif single and uris[0].key.endswith(INDEX_SUFFIX):
        index = uris[0]
        index_path = str(index)
        names = parse_index(await client.get_object(index, MAX_INDEX_BYTES), path=index_path)
        directory = index.key.rpartition("/")[0]
        prefix = f"{directory}/" if directory else ""
        shards = sorted(set(names.values()))
        files = [S3Uri(index.bucket, prefix + shard) for shard in shards]
        weight_map = {name: str(S3Uri(index.bucket, prefix + shard)) for name, shard in names.items()}
    else:
        if len({str(u) for u in uris}) != len(uris):
            raise SourceError("the list of checkpoint files names a file twice")
        for uri in uris:
            if uri.key == "" or uri.key.endswith("/"):
                raise SourceError("a list of checkpoint files must name objects, not prefixes", path=str(uri))
        files = uris
    gate = asyncio.Semaphore(_HEADER_REQUESTS)

    async def front(uri: S3Uri) -> Front:
        async with gate:
            data, info = await client.get_start(uri, client.config.header_bytes)
            return Front(info, data)

    if index_path is not None:
        return Opened(
            ResolvedSource(paths=tuple(str(u) for u in files), weight_map=weight_map, index_path=index_path),
            await _indexed_fronts(files, front, index_path),
        )
    try:
        fronts = await asyncio.gather(*(front(u) for u in files))
    except S3SourceError as error:
        if single and error.status == 404 and error.code != "NoSuchBucket":
            # s3://bucket/dir without the slash: a prefix, if it holds safetensors files.
            listed = await _maybe_prefix(client, files[0])
            if listed:
                return await _open(client, [S3Uri(files[0].bucket, files[0].key + "/")], single=True)
        raise
    resolved = ResolvedSource(
        paths=tuple(f.file.path for f in fronts), weight_map=weight_map, index_path=index_path
    )
    return Opened(resolved, tuple(fronts))


async def _indexed_fronts(
    files: list[S3Uri], front: Callable[[S3Uri], Coroutine[Any, Any, Front]], index_path: str
) -> tuple[Front, ...]:
    """The fronts of an index's shards; shards the bucket lacks (an interrupted upload) are one
    error naming the index and every missing shard, and a forbidden one names the index too."""
    results = await asyncio.gather(*(front(u) for u in files), return_exceptions=True)
    missing = [result for result in results if isinstance(result, S3MissingError)]
    if missing:
        keys = listed([error.key for error in missing], quoted=False)
        raise _restated(
            missing[0], f"the index {index_path} references {len(missing)} missing shard(s): {keys}"
        )
    for result in results:
        if isinstance(result, S3SourceError):
            raise _restated(
                result, f"the index {index_path} references a forbidden shard {result.key!r}: {result.reason}"
            )
        if isinstance(result, BaseException):
            raise result
    return tuple(result for result in results if isinstance(result, Front))


def _restated(error: S3SourceError, message: str) -> S3SourceError:
    """``error`` (its type, object, status and tries) with ``message``."""
    return type(error)(
        message,
        bucket=error.bucket,
        key=error.key,
        status=error.status,
        code=error.code,
        attempts=error.attempts,
    )


async def _list_prefix(client: S3Client, prefix: S3Uri) -> tuple[list[S3Uri], S3Uri | None]:
    """The ``*.safetensors`` objects directly under ``prefix``, and its index if it holds one (the
    source of truth, as for a local directory: only its shards are read)."""
    keys = await client.list_keys(prefix.bucket, prefix.key)
    indexes = [k[len(prefix.key) :] for k in keys if k.endswith(SAFETENSORS_INDEX_SUFFIX)]
    index = choose_index(indexes, where=str(prefix))
    if index is not None:
        return [], S3Uri(prefix.bucket, prefix.key + index)
    files = [S3Uri(prefix.bucket, k) for k in keys if k.endswith(_SUFFIX)]
    if not files:
        raise S3SourceError(
            "no *.safetensors object directly under this prefix", bucket=prefix.bucket, key=prefix.key
        )
    return files, None


async def _maybe_prefix(client: S3Client, uri: S3Uri) -> bool:
    if uri.key.endswith(_SUFFIX) or uri.key.endswith(INDEX_SUFFIX):
        return False
    keys = await client.list_keys(uri.bucket, uri.key + "/")
    return any(k.endswith(_SUFFIX) for k in keys)

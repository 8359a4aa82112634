"""An HTTP object store as a storage: ``<scheme>://bucket/key.safetensors``, a prefix
``<scheme>://bucket/prefix/`` and ``<scheme>://bucket/.../*.index.json``, by the same rules as a
local directory (``backends/sources.py``).

Opening lists the prefix or reads the index, then fetches the front of every file, all files at
once, each with one speculative ranged GET of the first ``header_bytes`` (which also gives the
object's size and version); ``read_ranges`` fetches the rest of a header longer than that. The one
client is made on first use and serves every run of the handle (``feeder.py``) until ``close()``.
A store (S3, GCS) subclasses ``ObjectStorage`` with its client; nothing here knows which it is.
"""

from __future__ import annotations

import abc
import asyncio
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, Protocol, TypeVar

from streamer.backends import base
from streamer.backends.http.client import ObjectStoreClient, RetrySettings, cancel_all
from streamer.backends.http.feeder import LandedCheck, ObjectFeeder
from streamer.backends.http.objects import ObjectUri, StoredObject
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
from streamer.engine import native
from streamer.errors import (
    ObjectMissingError,
    ObjectSourceError,
    ObjectStoreError,
    SourceError,
    StreamerError,
    listed,
)

_SUFFIX = ".safetensors"
_HEADER_REQUESTS = 32  # header GETs in flight at once

ClientT = TypeVar("ClientT", bound=ObjectStoreClient)


class StoreSettings(RetrySettings, Protocol):
    """A store's configuration (``S3Config``, ``GCSConfig``, ``AzureConfig``): its request bounds
    and how many GETs it keeps in flight."""

    @property
    def concurrency(self) -> int: ...


class ClientHolder(Generic[ClientT]):
    """A storage session's client: made on first use, reused by every run of the handle, closed
    with it (and made again if a closed handle is read once more)."""

    def __init__(self, make: Callable[[], ClientT]) -> None:
        self._make = make
        self._client: ClientT | None = None
        self._lock = threading.Lock()

    def get(self) -> ClientT:
        with self._lock:
            if self._client is None or self._client.loop.is_closed():
                self._client = self._make()
            return self._client

    def release_collector(self) -> None:
        """Ends the client's hold on garbage collection, if a client was made."""
        with self._lock:
            client = self._client
        if client is not None:
            client.release_collector()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


class ObjectStorage(base.Storage, Generic[ClientT]):
    """An object store's endpoint; one client, shared by the handle's runs.

    A store's subclass also says, for the node cache, without making a client: its settings
    (``config``: concurrency and request bounds), its place (``place``: what, with bucket, key
    and version, names an object anywhere), how its objects are made from a note (``stored``),
    its error type (``error_type``) and its name in metrics (``store``: ``<store>_files``).
    """

    delivery = base.Delivery.ONE_RECEIVER  # the client's event loop thread receives every byte
    config: StoreSettings
    error_type: type[ObjectStoreError] = ObjectStoreError
    store: str

    def __init__(self, make_client: Callable[[], ClientT]) -> None:
        self._holder = ClientHolder(make_client)

    @abc.abstractmethod
    def place(self, source: SourceLike) -> str | None:
        """The endpoint (S3), the API endpoint (GCS) or the account (Azure) ``source`` is read
        from: what makes a bucket name one bucket."""

    @abc.abstractmethod
    def stored(self, bucket: str, key: str, size: int, version: str | None) -> StoredObject:
        """The store's object of that name, size and version (as a header read would see it)."""

    def open(self, source: SourceLike) -> base.Opened:
        """Reads the fronts of the source's objects; garbage collection is held off from here until
        the next run's feed closes (``ObjectStoreClient.hold_collector``)."""
        client = self._holder.get()
        client.hold_collector()
        try:
            uris = [client.uri_type.parse(text) for text in source_texts(source)]
            return client.call(_open(client, uris, single=len(uris) == 1))
        except BaseException:
            client.release_collector()
            raise

    def release_collector(self) -> None:
        """Ends the last open's hold on garbage collection now (a storage that wraps this one and
        whose runs do not close this storage's feeds: the cache)."""
        self._holder.release_collector()

    def read_ranges(self, ranges: Sequence[base.Range]) -> list[bytes]:
        if not ranges:
            return []
        client = self._holder.get()
        return client.call(
            _read_ranges(client, [(stored_object(file), begin, end) for file, begin, end in ranges])
        )

    def identify(self, files: Sequence[base.StoredFile], *, full: bool) -> list[base.FileIdentity]:
        """Each object's version, as its header read saw it: every later GET is pinned to it, so it
        names the bytes read, whole."""
        return [base.FileIdentity(content=stored_object(file).version or "") for file in files]

    def feed(
        self,
        engine: native.Engine,
        files: Sequence[base.StoredFile],
        spans: Sequence[base.Extent],
        tensors: base.Named,
    ) -> base.Feed:
        objects = [stored_object(file) for file in files]
        return ObjectFeeder(self._holder.get(), engine, objects, self.landed_check())

    def landed_check(self) -> LandedCheck | None:
        """The store's check of each fetched block before it is credited (none by default)."""
        return None

    def client(self) -> ClientT:
        """The session's client (made on first use), for a storage that wraps this one (the cache)."""
        return self._holder.get()

    def close(self) -> None:
        self._holder.close()


def stored_object(file: base.StoredFile) -> StoredObject:
    """A file of an object store's open: the object its header read saw."""
    if not isinstance(file, StoredObject):
        raise StreamerError("not an object of a store", path=file.path)  # a bug: files come from this storage
    return file


async def _read_ranges(client: ObjectStoreClient, ranges: list[tuple[StoredObject, int, int]]) -> list[bytes]:
    gate = asyncio.Semaphore(_HEADER_REQUESTS)

    async def read(obj: StoredObject, begin: int, end: int) -> bytes:
        async with gate:
            return await client.get_bytes(obj, begin, end, source_errors=True)

    return list(await asyncio.gather(*(read(*r) for r in ranges)))


async def _open(client: ObjectStoreClient, uris: list[ObjectUri], *, single: bool) -> base.Opened:
    front = _front_reader(client)
    if single and (uris[0].key == "" or uris[0].key.endswith("/")):
        files, index = await _list_prefix(client, uris[0])
        if index is not None:
            return await _open_index(client, index, front, early=index_set(index, files))
    elif single and uris[0].key.endswith(INDEX_SUFFIX):
        return await _open_index(client, uris[0], front, early=[])
    else:
        if len({str(u) for u in uris}) != len(uris):
            raise SourceError("the list of checkpoint files names a file twice")
        for uri in uris:
            if uri.key == "" or uri.key.endswith("/"):
                raise SourceError("a list of checkpoint files must name objects, not prefixes", path=str(uri))
        files = uris
    try:
        fronts = await asyncio.gather(*(front(u) for u in files))
    except ObjectSourceError as error:
        if single and error.status == 404 and not client.bucket_missing(error):
            # <scheme>://bucket/dir without the slash: a prefix, if it holds safetensors files.
            found = await _maybe_prefix(client, files[0])
            if found:
                return await _open(client, [type(files[0])(files[0].bucket, files[0].key + "/")], single=True)
        raise
    resolved = ResolvedSource(paths=tuple(f.file.path for f in fronts), weight_map={}, index_path=None)
    return base.Opened(resolved, tuple(fronts))


FrontReader = Callable[[ObjectUri], Awaitable[base.Front]]


def _front_reader(client: ObjectStoreClient) -> FrontReader:
    """Reads an object's front (its header, size and version), ``_HEADER_REQUESTS`` at a time."""
    gate = asyncio.Semaphore(_HEADER_REQUESTS)

    async def front(uri: ObjectUri) -> base.Front:
        async with gate:
            data, obj = await client.get_start(uri, client.header_bytes)
            return base.Front(obj, data)

    return front


_SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<number>\d+)-of-(?P<total>\d+)\.safetensors")


def index_set(index: ObjectUri, listed: Sequence[ObjectUri]) -> list[ObjectUri]:
    """The listed objects that Hugging Face's naming says ``index`` names: for
    ``<stem>.safetensors.index.json``, a complete set ``<stem>-00001-of-0000N.safetensors`` to
    ``-0000N-of-0000N``, and nothing else of that stem; else none. Their fronts are read while the
    index is (a round trip less); the index still decides what is loaded, and a stray object
    (``consolidated.safetensors``, an older set) is never read."""
    stem = index.key.rpartition("/")[2].removesuffix(SAFETENSORS_INDEX_SUFFIX)
    numbered: dict[int, ObjectUri] = {}
    totals: set[str] = set()
    for uri in listed:
        match = _SHARD_NAME.fullmatch(uri.key.rpartition("/")[2])
        if match is None or match["stem"] != stem:
            continue
        number = int(match["number"])
        if number in numbered:  # one number spelt twice ("-1-of-2", "-01-of-2"): not one set
            return []
        numbered[number] = uri
        totals.add(match["total"])
    if (
        len(totals) != 1
        or len(numbered) != int(totals.pop())
        or min(numbered) != 1
        or max(numbered) != len(numbered)
    ):
        return []
    return [numbered[n] for n in sorted(numbered)]


async def _open_index(
    client: ObjectStoreClient, index: ObjectUri, front: FrontReader, *, early: Sequence[ObjectUri]
) -> base.Opened:
    """Opens the shards ``index`` names; the fronts of ``early`` (shards it very likely names) are
    read while the index itself is. What it does not name is cancelled, and its errors dropped."""
    index_path = str(index)
    started = {str(uri): asyncio.ensure_future(front(uri)) for uri in early}

    def shard_front(uri: ObjectUri) -> Awaitable[base.Front]:
        read = started.pop(str(uri), None)
        return read if read is not None else front(uri)

    try:
        names = parse_index(await client.get_object(index, MAX_INDEX_BYTES), path=index_path)
        directory = index.key.rpartition("/")[0]
        prefix = f"{directory}/" if directory else ""
        shards = {shard: type(index)(index.bucket, prefix + shard) for shard in sorted(set(names.values()))}
        fronts = await _indexed_fronts(list(shards.values()), shard_front, index_path)
    finally:
        await cancel_all(list(started.values()))
    weight_map = {name: str(shards[shard]) for name, shard in names.items()}
    resolved = ResolvedSource(
        paths=tuple(str(u) for u in shards.values()), weight_map=weight_map, index_path=index_path
    )
    return base.Opened(resolved, fronts)


async def _indexed_fronts(
    files: list[ObjectUri], front: FrontReader, index_path: str
) -> tuple[base.Front, ...]:
    """The fronts of an index's shards; shards the bucket lacks (an interrupted upload) are one
    error naming the index and every missing shard, and a forbidden one names the index too."""
    results = await asyncio.gather(*(front(u) for u in files), return_exceptions=True)
    missing = [result for result in results if isinstance(result, ObjectMissingError)]
    if missing:
        keys = listed([error.key for error in missing], quoted=False)
        raise _restated(
            missing[0], f"the index {index_path} references {len(missing)} missing shard(s): {keys}"
        )
    for result in results:
        if isinstance(result, ObjectSourceError):
            raise _restated(
                result, f"the index {index_path} references a forbidden shard {result.key!r}: {result.reason}"
            )
        if isinstance(result, BaseException):
            raise result
    return tuple(result for result in results if isinstance(result, base.Front))


def _restated(error: ObjectSourceError, message: str) -> ObjectSourceError:
    """``error`` (its type, object, status and tries) with ``message``."""
    return type(error)(
        message,
        bucket=error.bucket,
        key=error.key,
        status=error.status,
        code=error.code,
        attempts=error.attempts,
        scheme=error.scheme,
    )


async def _list_prefix(
    client: ObjectStoreClient, prefix: ObjectUri
) -> tuple[list[ObjectUri], ObjectUri | None]:
    """The ``*.safetensors`` objects directly under ``prefix``, and its index if it holds one (the
    source of truth, as for a local directory: only its shards are read)."""
    keys = await client.list_keys(prefix.bucket, prefix.key)
    indexes = [k[len(prefix.key) :] for k in keys if k.endswith(SAFETENSORS_INDEX_SUFFIX)]
    index = choose_index(indexes, where=str(prefix))
    files = [type(prefix)(prefix.bucket, k) for k in keys if k.endswith(_SUFFIX)]
    if index is not None:
        return files, type(prefix)(prefix.bucket, prefix.key + index)
    if not files:
        raise client.source_error("no *.safetensors object directly under this prefix", prefix)
    return files, None


async def _maybe_prefix(client: ObjectStoreClient, uri: ObjectUri) -> bool:
    if uri.key.endswith(_SUFFIX) or uri.key.endswith(INDEX_SUFFIX):
        return False
    keys = await client.list_keys(uri.bucket, uri.key + "/")
    return any(k.endswith(_SUFFIX) for k in keys)

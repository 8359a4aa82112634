"""The S3 storage with the node's cache in front: resolving goes to S3, and so do the headers, but
for a listed prefix whose objects' fronts the cache holds (the listing gives each object's size
and ETag, its identity in the cache; a header GET gives them otherwise). Each run's blocks are
served by a ``CacheFeed`` from the cache where it holds them and from S3 (written through) where
not.

Trusting the listing's size and ETag is trusting what the header GET would have said: S3 lists
what it serves (read-after-write consistent), and every GET of a missing chunk still carries
``If-Match`` with that ETag."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from streamer.backends.base import Feed, Named, Opened, Range, Span, Storage, StoredFile
from streamer.backends.cache.feed import CacheFeed
from streamer.backends.cache.store import ChunkStore, identity
from streamer.backends.s3.storage import S3Storage, s3_object
from streamer.backends.s3.uri import ObjectInfo
from streamer.config import CacheConfig
from streamer.engine import native
from streamer.sources import SourceLike

_FRONT_READERS = 8  # fronts read from the cache at once


class CachedS3Storage(Storage):
    """``inner`` with the cache ``config`` describes; the directory is opened on the first run."""

    # Threads copy from chunk buffers and read hits with O_DIRECT: fresh run buffers are best
    # faulted in ahead of them by the prefaulter, as for the S3 feeder's one receiving thread.
    one_receiver = True
    # Blocks on the file's block_size grid: with block_size a multiple of chunk_bytes (both 8 MiB by
    # default) every block holds whole chunks, fetched and written straight from the run's memory.
    file_grid = True

    def __init__(self, inner: S3Storage, config: CacheConfig, endpoint: str | None) -> None:
        assert config.dir is not None
        self._inner = inner
        self._config = config
        self._endpoint = endpoint
        self._store: ChunkStore | None = None

    def open(self, source: SourceLike) -> Opened:
        store = self._opened_store()
        with ThreadPoolExecutor(_FRONT_READERS, thread_name_prefix="streamer-cache-front") as readers:

            async def known_front(info: ObjectInfo) -> bytes | None:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(readers, self._cached_front, store, info)

            return self._inner.open(source, known_front=known_front)

    def _cached_front(self, store: ChunkStore, info: ObjectInfo) -> bytes | None:
        """The first ``header_bytes`` of the object from the cache, every piece checked; None
        unless the cache holds all of them (or the listing gave no ETag to key them by). A chunk
        failing its check is left for the run, which counts it, fetches it again and rewrites it."""
        length = min(self._inner.config.header_bytes, info.size)
        if info.etag is None or length == 0:
            return None
        ident = identity(self._endpoint, info.uri.bucket, info.uri.key, info.size, info.etag)
        chunk = self._config.chunk_bytes
        front = bytearray(length)
        with memoryview(front) as view:
            for index in range(0, (length - 1) // chunk + 1):
                first = index * chunk
                size = min(first + chunk, info.size) - first
                part = view[first : min(length, first + size)]
                if not store.read_into(ident, index, first, size, first, part, discard=False):
                    return None
        return bytes(front)

    def _opened_store(self) -> ChunkStore:
        if self._store is None:
            assert self._config.dir is not None
            self._store = ChunkStore(self._config.dir, self._config.max_bytes)
        return self._store

    def read_ranges(self, ranges: Sequence[Range]) -> list[bytes]:
        return self._inner.read_ranges(ranges)

    def feed(
        self, engine: native.Engine, files: Sequence[StoredFile], spans: Sequence[Span], tensors: Named
    ) -> Feed:
        store = self._opened_store()
        objects = [s3_object(file) for file in files]
        idents = [identity(self._endpoint, o.uri.bucket, o.uri.key, o.size, o.etag) for o in objects]
        return CacheFeed(
            self._inner.client(), store, self._config.chunk_bytes, engine, objects, idents, tensors
        )

    def close(self) -> None:
        self._inner.close()

"""The S3 storage with the node's cache in front: resolving and headers go to S3 (the header GET
gives each object's size and ETag, its identity in the cache); each run's blocks are served by a
``CacheFeed`` from the cache where it holds them and from S3 (written through) where not."""

from __future__ import annotations

from collections.abc import Sequence

from streamer.backends.base import Feed, Named, Opened, Range, Span, Storage, StoredFile
from streamer.backends.cache.feed import CacheFeed
from streamer.backends.cache.store import ChunkStore, identity
from streamer.backends.s3.storage import S3Storage, s3_object
from streamer.config import CacheConfig
from streamer.engine import native
from streamer.sources import SourceLike


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
        return self._inner.open(source)

    def read_ranges(self, ranges: Sequence[Range]) -> list[bytes]:
        return self._inner.read_ranges(ranges)

    def feed(
        self, engine: native.Engine, files: Sequence[StoredFile], spans: Sequence[Span], tensors: Named
    ) -> Feed:
        if self._store is None:
            assert self._config.dir is not None
            self._store = ChunkStore(self._config.dir, self._config.max_bytes)
        objects = [s3_object(file) for file in files]
        idents = [identity(self._endpoint, o.uri.bucket, o.uri.key, o.size, o.etag) for o in objects]
        return CacheFeed(
            self._inner.client(), self._store, self._config.chunk_bytes, engine, objects, idents, tensors
        )

    def close(self) -> None:
        self._inner.close()

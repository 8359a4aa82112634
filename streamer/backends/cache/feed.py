"""The cached part of one run: each block is served chunk by chunk, from the cache or from S3.

The cache keeps objects in chunks on a fixed grid of object offsets (``chunk_bytes``), so a later
load of any subset, layout or TP rank finds them. A hit is read in place (``ChunkStore.read_into``).
A miss is one ranged GET of the whole chunk, by a pool of fetcher threads (``s3.concurrency``:
the GETs in flight), so the chunks a block misses are fetched at once:

- a chunk the block holds whole is fetched straight into the block's memory and written to the
  cache from there; the block is credited after the write (then the run may reuse the memory).
  The cache storage asks the planner for blocks on the file's ``block_size`` grid, so with the
  default sizes (8 MiB both) that is every chunk but the one under each header;
- a chunk the block holds part of (the header's, or any when ``block_size`` is not a multiple of
  ``chunk_bytes``) is fetched into a shared, reused buffer; every block needing part of it copies
  its part while it is written from there.

Writes run on their own threads, so fetchers go on to their next GET at once. A write never
waits for a slot: with every slot busy (the disk is behind) the chunk is not cached, and counted.

Processes of a node share fills through the store's chunk locks: the filler holds the lock until
its chunk is in place, the others wait for it and read the chunk from the cache.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from streamer.backends.base import ExternalFeed, Named, tensor_at
from streamer.backends.cache.store import ChunkBuffer, ChunkLock, ChunkStore, piece_bytes
from streamer.backends.http import Connection
from streamer.backends.s3.client import S3Client
from streamer.backends.s3.uri import ObjectInfo
from streamer.engine import native
from streamer.errors import S3Error, StreamerError

_FILL_WAIT = 60.0  # seconds a loader waits for another process's fill before fetching itself
_WRITE_SLOTS = 32  # chunks written at once; all busy: the disk is behind (16 kept 58-84%, 32 91-99%)


class _Fetch:
    """A chunk this run fetches, into the one block's memory that holds it whole (``target``) or
    into a buffer shared by every block that needs part of it, by its fetcher and by the writer;
    that buffer goes back to the feed's spares when the last of them releases it."""

    __slots__ = ("chunk", "first", "key", "last", "result", "target", "users")

    def __init__(self, key: tuple[int, int], first: int, last: int, target: memoryview | None = None) -> None:
        self.key = key  # (engine file, chunk index)
        self.first, self.last = first, last  # the chunk's object bytes
        self.target = target
        self.chunk: ChunkBuffer | None = None
        self.result: Future[bool] = Future()  # whether another process had filled it
        self.users = 1  # the block that asked for it; guarded by the feed's mutex


class CacheFeed(ExternalFeed):
    """Serves the blocks of ``objects`` (engine files 0..n-1), ``idents`` their cache identities."""

    def __init__(
        self,
        client: S3Client,
        store: ChunkStore,
        chunk_bytes: int,
        engine: native.Engine,
        objects: Sequence[ObjectInfo],
        idents: Sequence[str],
        tensors: Named,
    ) -> None:
        super().__init__(engine, len(objects))
        self._client = client
        self._store = store
        self._chunk = chunk_bytes
        self._piece = piece_bytes(chunk_bytes)
        self._objects = tuple(objects)
        self._idents = tuple(idents)
        self._tensors = tensors
        self._counted = (client.requests, client.retries, client.bytes_fetched, store.errors)
        self._mutex = threading.Lock()
        self._filling: dict[tuple[int, int], _Fetch] = {}
        self._spare: list[ChunkBuffer] = []  # chunk buffers no fetch uses any more
        self._counters = {
            "cache_hit_bytes": 0,
            "cache_miss_bytes": 0,
            "cache_write_bytes": 0,
            "cache_dropped": 0,
        }
        deadline = client.config.load_deadline
        self._until = None if deadline is None else time.monotonic() + deadline
        self._blocks: queue.SimpleQueue[native.Block | None] = queue.SimpleQueue()
        self._fetches: queue.SimpleQueue[_Fetch | None] = queue.SimpleQueue()
        self._write_slots = threading.BoundedSemaphore(_WRITE_SLOTS)
        self._closed = False
        concurrency = client.config.concurrency
        self._servers = [
            threading.Thread(target=self._serve_loop, name="streamer-cache-serve", daemon=True)
            for _ in range(concurrency)
        ]
        self._fetchers = [
            threading.Thread(target=self._fetch_loop, name="streamer-cache-fetch", daemon=True)
            for _ in range(concurrency)
        ]
        self._write_pool = ThreadPoolExecutor(_WRITE_SLOTS, thread_name_prefix="streamer-cache-write")
        for thread in (*self._servers, *self._fetchers):
            thread.start()

    def submit(self, blocks: Sequence[native.Block]) -> None:
        if self._error is not None:
            raise self._error
        for block in blocks:
            self._blocks.put(block)

    def _serve_loop(self) -> None:
        while (block := self._blocks.get()) is not None:
            if self._error is None:
                self._serve(block)

    def _serve(self, block: native.Block) -> None:
        """Lands ``block``: its cached chunks read in place, the others fetched all at once by the
        fetchers. A chunk the block holds whole is fetched straight into the block's memory (the
        cache feeds' planner grid is the chunk grid, so with ``block_size`` a multiple of
        ``chunk_bytes`` that is nearly every chunk); a chunk it holds part of is fetched into a
        shared buffer and the part copied in."""
        info = self._objects[block.file]
        begin, end = block.acc_begin, block.acc_end
        view = native.writable_view(block.dst + (begin - block.read_offset), end - begin)
        waiting: list[tuple[_Fetch, int, int, int]] = []  # (fetch, chunk's first byte, low, high)
        try:
            for index in range(begin // self._chunk, (end - 1) // self._chunk + 1):
                first = index * self._chunk
                last = min(first + self._chunk, info.size)
                low, high = max(begin, first), min(end, last)
                part = view[low - begin : high - begin]
                if self._store.read_into(self._idents[block.file], index, first, last - first, low, part):
                    self._count("cache_hit_bytes", high - low)
                elif (low, high) == (first, last):
                    waiting.append(
                        (self._fetch_whole(block.file, index, first, last, part), first, low, high)
                    )
                else:
                    waiting.append((self._fetch(block.file, index, first, last), first, low, high))
            while waiting:
                fetch, first, low, high = waiting.pop(0)
                try:
                    cached = fetch.result.result()
                    if fetch.chunk is not None:
                        with fetch.chunk.data as data:
                            view[low - begin : high - begin] = data[low - first : high - first]
                finally:
                    self._release(fetch)
                self._count("cache_hit_bytes" if cached else "cache_miss_bytes", high - low)
        except S3Error as error:
            self.fail(error, block)
            return
        except Exception as exc:  # a bug must still end the run, never hang it
            name = tensor_at(self._tensors, block.file, begin)
            self.fail(
                StreamerError(
                    f"cache: unexpected failure: {type(exc).__name__}: {exc}", path=info.path, tensor=name
                ),
                block,
            )
            return
        finally:
            for fetch, *_ in waiting:
                self._release(fetch)
            view.release()
        self.credit(block)

    def _fetch(self, file: int, index: int, first: int, last: int) -> _Fetch:
        """The run's fetch of chunk ``index`` of engine file ``file`` into a shared buffer: the one
        under way (another block needs the same chunk) or a new one queued for the fetchers. A
        fetched chunk stays shared in memory until it is written, so the next block never waits
        for the writer. The caller releases it."""
        key = (file, index)
        with self._mutex:
            fetch = self._filling.get(key)
            if fetch is not None:
                fetch.users += 1
                return fetch
            fetch = self._filling[key] = _Fetch(key, first, last)
        self._fetches.put(fetch)
        return fetch

    def _fetch_whole(self, file: int, index: int, first: int, last: int, target: memoryview) -> _Fetch:
        """A fetch of chunk ``index`` straight into ``target``, the block's memory (no other block
        of the run needs it), queued for the fetchers. The caller releases it."""
        fetch = _Fetch((file, index), first, last, target)
        self._fetches.put(fetch)
        return fetch

    def _fetch_loop(self) -> None:
        connection = self._client.connection()
        try:
            while (fetch := self._fetches.get()) is not None:
                self._run_fetch(connection, fetch)
        finally:
            connection.close()

    def _run_fetch(self, connection: Connection, fetch: _Fetch) -> None:
        with self._mutex:
            fetch.users += 1  # this fetcher's, then the write's, until the fetch is settled
        try:
            if self._error is not None:
                raise self._error  # the run has failed: its blocks are dropped, fetch nothing more
            cached, lock = self._fill(connection, fetch)
        except BaseException as error:
            self._settle(fetch, error=error)
            return
        if lock is None:
            self._settle(fetch, cached)
        elif self._write_slots.acquire(blocking=False):
            if fetch.target is None:
                fetch.result.set_result(cached)  # blocks copy their parts while it is written
            self._write_pool.submit(self._write, fetch, cached, lock)
        else:  # every slot busy: the disk is behind, this chunk is not cached
            lock.release()
            self._count("cache_dropped", 1)
            self._settle(fetch, cached)

    def _write(self, fetch: _Fetch, cached: bool, lock: ChunkLock) -> None:
        """Writes a fetched chunk from where it landed, then settles the fetch: a block's own
        memory is credited only after (then the run may reuse it); the fetcher has already
        moved on to its next GET."""
        try:
            if fetch.target is not None:
                self._store_chunk(fetch, fetch.target)
            else:
                assert fetch.chunk is not None
                with fetch.chunk.data as data:
                    self._store_chunk(fetch, data)
        finally:
            self._write_slots.release()
            self._settle(fetch, cached)  # forgotten before the lock goes: waiters find it on disk
            lock.release()

    def _store_chunk(self, fetch: _Fetch, data: memoryview) -> None:
        file, index = fetch.key
        if self._store.write(self._idents[file], index, fetch.first, data, self._piece):
            self._count("cache_write_bytes", len(data))

    def _settle(self, fetch: _Fetch, cached: bool = False, error: BaseException | None = None) -> None:
        """Publishes the fetch's outcome (unless already out), forgets a shared fetch (later
        blocks find its chunk in the cache, or fetch it again) and ends this thread's use of it."""
        if not fetch.result.done():
            if error is None:
                fetch.result.set_result(cached)
            else:
                fetch.result.set_exception(error)
        if fetch.target is None:
            self._forget(fetch.key)
        self._release(fetch)

    def _forget(self, key: tuple[int, int]) -> None:
        with self._mutex:
            del self._filling[key]

    def _release(self, fetch: _Fetch) -> None:
        """One user of ``fetch`` is done with its chunk; the last one gives it back for reuse."""
        with self._mutex:
            fetch.users -= 1
            if fetch.users == 0 and fetch.chunk is not None:
                self._spare.append(fetch.chunk)

    def _fill(self, connection: Connection, fetch: _Fetch) -> tuple[bool, ChunkLock | None]:
        """Lands the chunk in ``fetch.target`` or ``fetch.chunk``: from the cache if another
        process filled it while we waited for its lock (True), else from S3; and, when it is ours
        to write, its lock."""
        (file, index), first, last = fetch.key, fetch.first, fetch.last
        ident = self._idents[file]
        lock = self._store.lock(ident, index, _FILL_WAIT)
        if fetch.target is not None:
            view = fetch.target[:]
        else:
            with self._mutex:
                chunk = self._spare.pop() if self._spare else ChunkBuffer(self._chunk)
            chunk.length = last - first
            fetch.chunk = chunk
            view = chunk.data
        try:
            if lock is not None and self._store.read_into(ident, index, first, last - first, first, view):
                lock.release()
                return True, None
            self._client.call(
                self._client.fetch_into(connection, self._objects[file], first, last, view, until=self._until)
            )
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        finally:
            view.release()
        return False, lock

    def _count(self, name: str, amount: int) -> None:
        with self._mutex:
            self._counters[name] += amount

    def stats(self) -> dict[str, int]:
        client, store = self._client, self._store
        with self._mutex:
            counters = dict(self._counters)
        return {
            "s3_files": len(self._objects),
            "requests": client.requests - self._counted[0],
            "retries": client.retries - self._counted[1],
            "bytes_fetched": client.bytes_fetched - self._counted[2],
            "cache_errors": store.errors - self._counted[3],
            **counters,
        }

    def close(self) -> None:
        """Stops the servers (after the block each is serving: the fetches they wait for finish,
        bounded by the client's deadlines), then the fetchers, and lets the writer finish what it
        holds (its chunks are copies, not the run's memory). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            while True:
                self._blocks.get_nowait()  # queued blocks are dropped
        for _ in self._servers:
            self._blocks.put(None)
        for thread in self._servers:
            thread.join()
        for _ in self._fetchers:
            self._fetches.put(None)
        for thread in self._fetchers:
            thread.join()
        self._write_pool.shutdown(wait=True)

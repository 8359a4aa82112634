"""The cached part of one run: each block is served chunk by chunk, from the cache or from the
object store (S3, GCS, Azure Blob).

The cache keeps objects in chunks on a fixed grid of object offsets (``chunk_bytes``), so a later
load of any subset, layout or TP rank finds them. Three kinds of workers serve a run:

- serve threads (``_SERVE_THREADS``) take the run's blocks, read their cached chunks in place
  (``ChunkStore.read_into``: O_DIRECT, every piece checked) and start a fetch for each chunk
  missing, its chunk lock taken; a block with fetches outstanding is credited by whoever settles
  the last of them, so the thread goes on to the next block at once. At most ``concurrency``
  fetches are started and not landed: the serve threads run no further ahead of the GETs, and
  the locks held (a descriptor each) stay bounded however many chunks a checkpoint has;
- fetch tasks on the store client's event loop (``concurrency`` of them, as in its feeder)
  send one ranged GET per missing chunk, received straight into the block's memory when the
  block holds the chunk whole (with ``block_size`` a multiple of ``chunk_bytes``, both 8 MiB by
  default, every chunk but the one under each header: the storage asks the planner for blocks
  on that grid), else into a chunk buffer shared by every block needing part of it;
- writer threads (``_WRITERS``) write fetched chunks to the cache from where they landed. A
  block's own memory is credited only once written (then the run may reuse it); the parts of a
  shared chunk are copied out first. Up to ``concurrency`` chunks wait for a writer or are
  being written; with all those slots taken (the disk is behind) a chunk is not cached, and
  counted: a write never holds up the GETs.

Processes of a node share fills through the store's chunk locks: the fetch of a chunk holds its
lock until the chunk is in place; a chunk another process holds is waited for on a waiter thread
(up to ``_FILL_WAIT`` seconds), then read from the cache, or fetched when it is not there.

A run planned from a provisional open (``storage.py``) has a ``go_ahead``: until it is done, the
serve threads read hits but blocks are held, not credited, and no fetch starts (the client is
taken, and the fetch tasks started, at the first fetch); then the held blocks are credited, or
failed with its error (the source changed, or the store refused it).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from streamer.backends.base import ExternalFeed, Named, tensor_at
from streamer.backends.cache.store import ChunkBuffer, ChunkLock, ChunkStore, piece_bytes
from streamer.backends.http.client import ObjectStoreClient, cancel_all
from streamer.backends.http.connection import Connection
from streamer.backends.http.objects import StoredObject
from streamer.backends.http.storage import StoreSettings
from streamer.engine import native
from streamer.errors import ObjectStoreError, StreamerError

_FILL_WAIT = 60.0  # seconds a loader waits for another process's fill before fetching itself
# Chunks written at once: few, the disk writes fastest so (O_DIRECT, 8 MiB: 2.1 GB/s at 4, 1.7 GB/s
# at 32 on this project's VMs; 32 writers made a 4 GiB fill 1.11x slower than 4).
_WRITERS = 4
_SERVE_THREADS = 8  # cache reads in flight, as the local reader's threads


class _Block:
    """A block being served: credited (or failed) when its last outstanding part settles."""

    __slots__ = ("block", "error", "outstanding", "view")

    def __init__(self, block: native.Block, view: memoryview) -> None:
        self.block = block
        self.view = view  # the block's credited bytes
        self.outstanding = 1  # the serving thread's own hold, until it has started every fetch
        self.error: StreamerError | None = None


class _Fetch:
    """One chunk fetched by this run, into the one block's memory that holds it whole
    (``target``) or into a shared ``chunk`` buffer whose parts the ``waiters`` copy."""

    __slots__ = (
        "cached",
        "chunk",
        "fetched",
        "first",
        "key",
        "last",
        "lock",
        "slot",
        "target",
        "users",
        "waiters",
    )

    def __init__(self, key: tuple[int, int], first: int, last: int, target: memoryview | None) -> None:
        self.key = key  # (engine file, chunk index)
        self.first, self.last = first, last  # the chunk's object bytes
        self.target = target
        self.chunk: ChunkBuffer | None = None
        self.lock: ChunkLock | None = None  # held while this run fills the chunk
        self.slot = False  # holds one of the feed's fetch slots
        self.waiters: list[tuple[_Block, int, int]] = []  # (block, low, high): its object bytes here
        self.fetched = False  # shared chunk: landed, later blocks copy it at once
        self.cached = False  # landed from the cache: another process filled it meanwhile
        self.users = 1  # of a shared chunk buffer: the fetch itself, and blocks copying from it


class CacheFeed(ExternalFeed):
    """Serves the blocks of ``objects`` (engine files 0..n-1), ``idents`` their cache identities;
    ``client`` gives the store's client (made on first use), ``config`` is the store's (its
    concurrency and load deadline), ``error_type`` its errors', ``store_name`` its name in metrics,
    ``go_ahead`` the provisional open's."""

    def __init__(
        self,
        client: Callable[[], ObjectStoreClient],
        config: StoreSettings,
        error_type: type[ObjectStoreError],
        store_name: str,
        store: ChunkStore,
        chunk_bytes: int,
        engine: native.Engine,
        objects: Sequence[StoredObject],
        idents: Sequence[str],
        tensors: Named,
        go_ahead: Future[None] | None = None,
    ) -> None:
        super().__init__(engine, len(objects))
        self._client_of = client
        self._client: ObjectStoreClient | None = None  # taken at the first fetch
        self._error_type = error_type
        self._store_name = store_name
        self._counted = (0, 0, 0, 0, 0)  # the client's counters then
        self._connecting = threading.Lock()
        self._config = config
        self._store = store
        self._chunk = chunk_bytes
        self._piece = piece_bytes(chunk_bytes)
        self._objects = tuple(objects)
        self._idents = tuple(idents)
        self._tensors = tensors
        self._store_errors, self._store_evictions = store.errors, store.evictions
        self._mutex = threading.Lock()
        self._shared: dict[tuple[int, int], _Fetch] = {}  # shared chunks fetched or being written
        self._locked: set[_Fetch] = set()  # fetches holding their chunk's lock
        self._spare: list[ChunkBuffer] = []  # chunk buffers no fetch uses any more
        self._counters = {
            "cache_hit_bytes": 0,
            "cache_miss_bytes": 0,
            "cache_write_bytes": 0,
            "cache_dropped": 0,
        }
        deadline = config.load_deadline
        self._until = None if deadline is None else time.monotonic() + deadline
        self._closing = threading.Event()
        self._closed = False
        self._blocks: queue.SimpleQueue[native.Block | None] = queue.SimpleQueue()
        # Chunks waiting to be written or being written: as many as the GETs in flight, so a wave of
        # GETs landing together is written, not dropped (32 slots dropped 17-65 of 512 chunks).
        self._write_slots = threading.BoundedSemaphore(config.concurrency)
        # Fetches started and not yet landed (a chunk lock each): the serve threads go no further
        # ahead of the GETs in flight than this.
        self._fetch_slots = threading.BoundedSemaphore(config.concurrency)
        self._write_pool = ThreadPoolExecutor(_WRITERS, thread_name_prefix="streamer-cache-write")
        self._wait_pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="streamer-cache-wait")
        self._fetches: asyncio.Queue[_Fetch] | None = None
        self._fetchers: list[asyncio.Task[None]] = []
        # None until the go-ahead: blocks are held; then True, or the error they all fail with.
        self._go: bool | StreamerError | None = True if go_ahead is None else None
        self._held: list[native.Block] = []
        self._answered = threading.Event()
        self._settling = threading.Lock()  # held blocks being settled; close() waits for them
        self._servers = [
            threading.Thread(target=self._serve_loop, name="streamer-cache-serve", daemon=True)
            for _ in range(_SERVE_THREADS)
        ]
        for thread in self._servers:
            thread.start()
        if go_ahead is None:
            self._answered.set()
        else:
            go_ahead.add_done_callback(self._on_go_ahead)

    def _on_go_ahead(self, go_ahead: Future[None]) -> None:
        """Credits the blocks held for the go-ahead, or fails them with its error."""
        failure = go_ahead.exception()
        verdict: bool | StreamerError
        if failure is None:
            verdict = True
        elif isinstance(failure, StreamerError):
            verdict = failure
        else:  # a bug while opening: the run must still end
            verdict = StreamerError(
                f"cache: confirming the open failed: {type(failure).__name__}: {failure}",
                path=self._objects[0].path if self._objects else None,
            )
        with self._settling:
            if self._closed:
                return
            with self._mutex:
                self._go, held, self._held = verdict, self._held, []
            self._answered.set()
            for block in held:
                if isinstance(verdict, StreamerError):
                    self.fail(verdict, block)
                else:
                    self.credit(block)

    def _connected(self) -> ObjectStoreClient | None:
        """The store's client, this feed's fetch tasks started on it, once the run may go ahead; None
        when the feed closes first. Raises the error the run may not go ahead for."""
        while not self._answered.wait(0.1):
            if self._closing.is_set():
                return None
        if isinstance(self._go, StreamerError):
            raise self._go
        with self._connecting:
            if self._client is None:
                client = self._client_of()
                self._counted = client.counters()
                client.call(self._start_fetchers(client, self._config.concurrency))
                self._client = client
            return self._client

    async def _start_fetchers(self, client: ObjectStoreClient, concurrency: int) -> None:
        self._fetches = asyncio.Queue()
        self._fetchers = [asyncio.create_task(self._fetch_loop(client)) for _ in range(concurrency)]

    def submit(self, blocks: Sequence[native.Block]) -> None:
        if self._error is not None:
            raise self._error
        for block in blocks:
            self._blocks.put(block)

    # --- serving blocks (serve threads) --------------------------------------------------

    def _serve_loop(self) -> None:
        while (block := self._blocks.get()) is not None:
            if self._error is None:
                self._serve(block)

    def _serve(self, block: native.Block) -> None:
        """Reads the block's cached chunks in place and starts a fetch for each missing one."""
        info = self._objects[block.file]
        begin, end = block.acc_begin, block.acc_end
        served = _Block(block, native.writable_view(block.dst + (begin - block.read_offset), end - begin))
        try:
            for index in range(begin // self._chunk, (end - 1) // self._chunk + 1):
                first = index * self._chunk
                last = min(first + self._chunk, info.size)
                low, high = max(begin, first), min(end, last)
                part = served.view[low - begin : high - begin]
                if self._store.read_into(self._idents[block.file], index, first, last - first, low, part):
                    self._count("cache_hit_bytes", high - low)
                elif (low, high) == (first, last):
                    fetch = _Fetch((block.file, index), first, last, part)
                    fetch.waiters.append((served, low, high))
                    served.outstanding += 1
                    self._start(fetch)
                else:
                    self._join_shared(served, block.file, index, first, last, low, high)
        except Exception as exc:  # a bug must still end the run, never hang it
            served.error = self._unexpected(exc, block)
        self._settle_part(served)

    def _join_shared(
        self, served: _Block, file: int, index: int, first: int, last: int, low: int, high: int
    ) -> None:
        """Gets bytes ``[low, high)`` of chunk ``index`` (one the block holds part of) through
        the run's shared fetch of it: copied now if it has landed, else when it does."""
        with self._mutex:
            fetch = self._shared.get((file, index))
            new = fetch is None
            if fetch is None:
                fetch = self._shared[(file, index)] = _Fetch((file, index), first, last, None)
            landed = fetch.fetched
            if landed:
                fetch.users += 1
            else:
                fetch.waiters.append((served, low, high))
                served.outstanding += 1
        if landed:
            try:
                self._copy_part(fetch, served, low, high)
            finally:
                self._release_buffer(fetch)
            self._count("cache_hit_bytes" if fetch.cached else "cache_miss_bytes", high - low)
        elif new:
            self._start(fetch)

    def _start(self, fetch: _Fetch) -> None:
        """Takes a fetch slot (waiting while ``s3.concurrency`` fetches are under way) and the
        chunk's lock, and queues the fetch; a chunk another process is filling is waited for on a
        waiter thread instead."""
        while not self._fetch_slots.acquire(timeout=0.1):
            if self._closing.is_set():
                return
        fetch.slot = True
        try:
            ident, index = self._idents[fetch.key[0]], fetch.key[1]
            lock = self._store.lock(ident, index, 0.0)
            if lock is None and self._store.writable:
                self._wait_pool.submit(self._wait_for_fill, fetch)
            else:
                self._begin(fetch, lock)
        except Exception as exc:  # no memory for a chunk buffer, or a bug: its blocks fail
            self._abandon(fetch, self._failure(fetch, exc))

    def _wait_for_fill(self, fetch: _Fetch) -> None:
        """Waits for another process's fill of the chunk, up to ``_FILL_WAIT`` seconds or the
        load deadline, then takes it from the cache or fetches it."""
        wait = _FILL_WAIT
        if self._until is not None:
            wait = max(0.0, min(wait, self._until - time.monotonic()))
        try:
            ident, index = self._idents[fetch.key[0]], fetch.key[1]
            self._begin(fetch, self._store.lock(ident, index, wait, stop=self._closing))
        except Exception as exc:
            self._abandon(fetch, self._failure(fetch, exc))

    def _abandon(self, fetch: _Fetch, error: StreamerError) -> None:
        """Ends a failed fetch: its lock and slot go back, its blocks fail with ``error``."""
        self._unlock(fetch)
        self._release_slot(fetch)
        self._fetched(fetch, error=error)

    def _failure(self, fetch: _Fetch, exc: Exception) -> ObjectStoreError:
        """An unexpected exception (no memory for a chunk buffer, a bug) as a typed error naming
        the object and the bytes."""
        info = self._objects[fetch.key[0]]
        return self._error_type(
            f"cache: unexpected failure: {type(exc).__name__}: {exc}",
            bucket=info.uri.bucket,
            key=info.uri.key,
            byte_range=(fetch.first, fetch.last),
            scheme=info.uri.scheme,
        )

    def _release_slot(self, fetch: _Fetch) -> None:
        with self._mutex:
            held, fetch.slot = fetch.slot, False
        if held:
            self._fetch_slots.release()

    def _begin(self, fetch: _Fetch, lock: ChunkLock | None) -> None:
        """With the lock (or without, when the cache cannot hold it): the chunk from the cache
        when another process filled it meanwhile, else queued for the fetch tasks."""
        if self._closing.is_set():  # the run is over: nothing waits for this chunk any more
            if lock is not None:
                lock.release()
            return
        if fetch.target is None:
            with self._mutex:
                fetch.chunk = self._spare.pop() if self._spare else ChunkBuffer(self._chunk)
            fetch.chunk.length = fetch.last - fetch.first
        if lock is not None:
            with self._mutex:
                fetch.lock = lock
                self._locked.add(fetch)
            file, index = fetch.key
            with self._land(fetch) as view:
                filled = self._store.read_into(
                    self._idents[file], index, fetch.first, fetch.last - fetch.first, fetch.first, view
                )
            if filled:
                self._unlock(fetch)
                self._release_slot(fetch)
                self._fetched(fetch, cached=True)
                return
        try:
            client = self._connected()
        except StreamerError as error:
            self._abandon(fetch, error)
            return
        if client is None:
            self._unlock(fetch)
            return
        client.loop.call_soon_threadsafe(self._queue_fetch, fetch)

    def _queue_fetch(self, fetch: _Fetch) -> None:
        assert self._fetches is not None
        self._fetches.put_nowait(fetch)

    # --- fetching (tasks on the client's loop) -------------------------------------------

    async def _fetch_loop(self, client: ObjectStoreClient) -> None:
        assert self._fetches is not None
        connection = client.connection()
        try:
            while True:
                fetch = await self._fetches.get()
                try:
                    await self._fetch(client, connection, fetch)
                except Exception as exc:  # a bug must still end the run, never stop this task
                    self._abandon(fetch, self._failure(fetch, exc))
        finally:
            connection.close()

    async def _fetch(self, client: ObjectStoreClient, connection: Connection, fetch: _Fetch) -> None:
        info = self._objects[fetch.key[0]]
        error: StreamerError | None = self._error  # the run has failed: fetch nothing more
        if error is None:
            try:
                with self._land(fetch) as view:
                    await client.fetch_into(
                        connection, info, fetch.first, fetch.last, view, until=self._until
                    )
            except ObjectStoreError as failure:
                error = failure
            except Exception as exc:  # a bug must still end the run, never hang it
                error = self._failure(fetch, exc)
        # The fetch slot goes back once the lock has (or the writer holds it): the locks held stay
        # within the fetch slots plus the write slots.
        if error is not None:
            self._abandon(fetch, error)
        elif fetch.lock is not None and self._write_slots.acquire(blocking=False):
            self._release_slot(fetch)
            self._write_pool.submit(self._write, fetch)
        else:
            if fetch.lock is not None:  # every slot busy: the disk is behind, not cached
                self._count("cache_dropped", 1)
                self._unlock(fetch)
            self._release_slot(fetch)
            self._fetched(fetch)

    # --- landing (writer threads, or wherever a fetch ends) ------------------------------

    def _write(self, fetch: _Fetch) -> None:
        """Writes a fetched chunk from where it landed: a shared chunk's parts are copied out
        first, a block's own memory is credited only after (then the run may reuse it)."""
        shared = fetch.target is None
        try:
            if shared:
                self._fetched(fetch)
            file, index = fetch.key
            with self._land(fetch) as data:
                if self._store.write(self._idents[file], index, fetch.first, data, self._piece):
                    self._count("cache_write_bytes", len(data))
        finally:
            self._write_slots.release()
            if shared:
                self._forget(fetch)  # before the lock goes: later blocks find the chunk on disk
            else:
                self._fetched(fetch)
            self._unlock(fetch)

    def _fetched(self, fetch: _Fetch, *, cached: bool = False, error: StreamerError | None = None) -> None:
        """Settles the blocks waiting for ``fetch``: their parts of a shared chunk copied (or
        the error recorded), each credited if it was its last outstanding part. A shared chunk
        that landed stays for later blocks until written; one that failed is forgotten."""
        with self._mutex:
            waiters, fetch.waiters = fetch.waiters, []
            fetch.fetched, fetch.cached = error is None, cached
            writing = fetch.lock is not None  # the writer forgets a shared chunk once written
        for served, low, high in waiters:
            if error is not None:
                served.error = served.error or error
            elif fetch.target is None:
                try:
                    self._copy_part(fetch, served, low, high)
                except Exception as exc:  # a bug must still end the run, never hang it
                    served.error = served.error or self._unexpected(exc, served.block)
            if error is None:
                self._count("cache_hit_bytes" if cached else "cache_miss_bytes", high - low)
            self._settle_part(served)
        if fetch.target is None and not writing:
            self._forget(fetch)

    def _copy_part(self, fetch: _Fetch, served: _Block, low: int, high: int) -> None:
        assert fetch.chunk is not None
        begin = served.block.acc_begin
        with fetch.chunk.data as data:
            served.view[low - begin : high - begin] = data[low - fetch.first : high - fetch.first]

    def _settle_part(self, served: _Block) -> None:
        """One outstanding part of ``served`` is done; the last one credits or fails the block."""
        with self._mutex:
            served.outstanding -= 1
            if served.outstanding:
                return
            served.view.release()
            go = self._go
            if go is None and served.error is None:
                self._held.append(served.block)  # credited (or failed) by the go-ahead
                return
        error = served.error or (go if isinstance(go, StreamerError) else None)
        if error is None:
            self.credit(served.block)
        else:
            self.fail(error, served.block)

    def _unexpected(self, exc: Exception, block: native.Block) -> StreamerError:
        return StreamerError(
            f"cache: unexpected failure: {type(exc).__name__}: {exc}",
            path=self._objects[block.file].path,
            tensor=tensor_at(self._tensors, block.file, block.acc_begin),
        )

    @contextlib.contextmanager
    def _land(self, fetch: _Fetch) -> Iterator[memoryview]:
        """The memory the chunk lands in (and is written from)."""
        if fetch.target is not None:
            view = fetch.target[:]
        else:
            assert fetch.chunk is not None
            view = fetch.chunk.data
        try:
            yield view
        finally:
            view.release()

    def _forget(self, fetch: _Fetch) -> None:
        """Drops a shared fetch (later blocks find its chunk on disk, or fetch it again) and its
        own use of its buffer; once only."""
        with self._mutex:
            if self._shared.get(fetch.key) is not fetch:
                return
            del self._shared[fetch.key]
        self._release_buffer(fetch)

    def _release_buffer(self, fetch: _Fetch) -> None:
        """One user of a shared chunk buffer is done; the last one gives it back for reuse."""
        with self._mutex:
            fetch.users -= 1
            if fetch.users == 0 and fetch.chunk is not None:
                self._spare.append(fetch.chunk)

    def _unlock(self, fetch: _Fetch) -> None:
        with self._mutex:
            lock, fetch.lock = fetch.lock, None
            self._locked.discard(fetch)
        if lock is not None:
            lock.release()

    def _count(self, name: str, amount: int) -> None:
        with self._mutex:
            self._counters[name] += amount

    def stats(self) -> dict[str, int]:
        client = self._client
        now = self._counted if client is None else client.counters()
        with self._mutex:
            counters = dict(self._counters)
        return {
            f"{self._store_name}_files": len(self._objects),
            "requests": now[0] - self._counted[0],
            "retries": now[1] - self._counted[1],
            "bytes_fetched": now[2] - self._counted[2],
            "throttles": now[3] - self._counted[3],
            "cache_errors": self._store.errors - self._store_errors,
            "cache_evictions": self._store.evictions - self._store_evictions,
            **counters,
        }

    def close(self) -> None:
        """Returns once nothing of this feed can write into the run's memory or read from it:
        queued blocks are dropped, the serve threads end after their block, waits for other
        processes' fills end, fetches in flight are cancelled and the writes under way finish;
        every chunk lock still held is released. Idempotent."""
        with self._settling:  # no held block is credited from now on
            if self._closed:
                return
            self._closed = True
        self._closing.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._blocks.get_nowait()
        for _ in self._servers:
            self._blocks.put(None)
        for thread in self._servers:
            thread.join()
        self._wait_pool.shutdown(wait=True, cancel_futures=True)
        if self._client is not None:
            self._client.call(self._stop_fetchers())
        self._write_pool.shutdown(wait=True)
        with self._mutex:
            locked, self._locked = list(self._locked), set()
        for fetch in locked:
            if fetch.lock is not None:
                fetch.lock.release()

    async def _stop_fetchers(self) -> None:
        fetchers, self._fetchers = self._fetchers, []
        await cancel_all(fetchers)

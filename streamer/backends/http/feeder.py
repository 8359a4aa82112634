"""An HTTP object store's part of one run: worker tasks fetch blocks straight into the run's buffers.

A fixed number of worker tasks (the ``concurrency``) on the client's event loop pull blocks from a
queue, fetch each with a ranged GET whose body is received straight into the block's destination
memory, and credit the block to the native engine exactly as a reader thread would; the first
failure stops the run (``ExternalFeed.fail``), so its waiter wakes as for a failed local read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from streamer.backends.base import ExternalFeed
from streamer.backends.http.client import COUNTERS, Fatal, ObjectStoreClient, cancel_all
from streamer.backends.http.connection import Connection
from streamer.backends.http.objects import StoredObject
from streamer.engine import native
from streamer.errors import StreamerError

# A store's check of bytes that landed (GCS: the whole object's CRC32C): called with the object,
# the bytes [begin, end) and their address before the block is credited; raises ``Fatal`` when
# they must not count. It must not return while it still reads the block's memory.
LandedCheck = Callable[[StoredObject, int, int, int], Awaitable[None]]


class ObjectFeeder(ExternalFeed):
    """Fetches the blocks of ``objects`` (engine files 0..n-1) for one run and credits them.

    ``submit`` may be called from the run's thread at any time; ``close`` (before the engine
    closes) cancels what is queued or running and returns once no request can write into
    destination memory any more. Its counters are the run's share of the shared client's.
    ``check``: the store's check of each block's bytes before it is credited, if it has one.
    """

    def __init__(
        self,
        client: ObjectStoreClient,
        engine: native.Engine,
        objects: Sequence[StoredObject],
        check: LandedCheck | None = None,
    ) -> None:
        super().__init__(engine, len(objects))
        self._client = client
        self._objects = tuple(objects)
        self._check = check
        self._counted = client.counters()
        self._queue: asyncio.Queue[native.Block] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._closed = False
        deadline = client.settings.load_deadline
        self._until = None if deadline is None else time.monotonic() + deadline
        client.call(self._start(client.concurrency))

    async def _start(self, concurrency: int) -> None:
        self._queue = asyncio.Queue()
        self._workers = [asyncio.create_task(self._work()) for _ in range(concurrency)]

    def submit(self, blocks: Sequence[native.Block]) -> None:
        if self._error is not None:
            raise self._error
        batch = list(blocks)
        self._client.loop.call_soon_threadsafe(self._enqueue, batch)

    def _enqueue(self, blocks: list[native.Block]) -> None:
        assert self._queue is not None
        for block in blocks:
            self._queue.put_nowait(block)

    async def _work(self) -> None:
        connection = self._client.connection()
        try:
            await self._work_on(connection)
        finally:
            connection.close()

    async def _work_on(self, connection: Connection) -> None:
        assert self._queue is not None
        queue = self._queue
        while True:
            block = await queue.get()
            if self._error is not None:
                continue  # the run failed: drop the rest
            info = self._objects[block.file]
            # Only the credited bytes are needed: the planner's alignment padding is for O_DIRECT.
            begin, end = block.acc_begin, block.acc_end
            address = block.dst + (begin - block.read_offset)
            view = native.writable_view(address, end - begin)
            try:
                await self._client.fetch_into(connection, info, begin, end, view, until=self._until)
                if self._check is not None:
                    await self._check(info, begin, end, address)
            except StreamerError as error:
                self.fail(error, block)
                continue
            except Exception as exc:  # the store's check refused the bytes, or a bug: never a hang
                failure = exc
                if not isinstance(failure, Fatal):
                    failure = Fatal(f"unexpected failure: {type(exc).__name__}: {exc}")
                refused = self._client.error(
                    failure, info.uri, (begin, end), 1, reason=failure.reason, source_errors=False
                )
                self.fail(refused, block)
                continue
            finally:
                view.release()
            self.credit(block)

    def stats(self) -> dict[str, int]:
        client = self._client
        grown = zip(COUNTERS, client.counters(), self._counted, strict=True)
        return {f"{client.store}_files": len(self._objects), **{key: now - then for key, now, then in grown}}

    def close(self) -> None:
        """Cancels every worker and waits until they are gone; the run is over, so it ends the
        open's hold on garbage collection. Idempotent."""
        self._client.release_collector()
        if not self._closed:
            self._closed = True
            self._client.call(self._stop())

    async def _stop(self) -> None:
        workers, self._workers = self._workers, []
        await cancel_all(workers)

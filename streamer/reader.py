"""What a run reads through: the native engine, plus the S3 backend for the files that are S3 objects.

Blocks of local files go to the engine's reader threads; blocks of S3 objects go to an
``S3Feeder``, which credits them to the same engine as they land. Completions, the wait with the
GIL released, the first-error rule and cancellation are the engine's, whatever the storage:
the runs above see one ``submit`` / ``wait`` / ``close``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from streamer.backends.s3 import ObjectInfo, S3Client, S3Feeder
from streamer.engine import native


class Reader:
    """The engine (its files opened by the caller) and, when ``objects`` is not empty, an S3 feeder."""

    def __init__(self, engine: native.Engine) -> None:
        self._engine = engine
        self._client: S3Client | None = None
        self._feeder: S3Feeder | None = None
        self._remote: frozenset[int] = frozenset()
        self._counted = (0, 0, 0)

    def attach_s3(self, client: S3Client, objects: Mapping[int, ObjectInfo]) -> None:
        """Serves the blocks of engine files ``objects`` (registered as external files) from S3
        with ``client`` (shared with the checkpoint, which closes it)."""
        self._client = client
        self._counted = (client.requests, client.retries, client.bytes_fetched)
        self._feeder = S3Feeder(client, self._engine, objects)
        self._remote = frozenset(objects)

    def add_file(self, path: str, want_direct: bool) -> tuple[int, bool]:
        return self._engine.add_file(path, want_direct)

    def add_external_file(self) -> int:
        return self._engine.add_external_file()

    def submit(self, blocks: Sequence[native.Block]) -> None:
        if self._feeder is None:
            self._engine.submit(blocks)
            return
        remote = [b for b in blocks if b.file in self._remote]
        local = [b for b in blocks if b.file not in self._remote]
        if remote:
            self._feeder.submit(remote)
        if local:
            self._engine.submit(local)

    def wait(self, timeout_ms: int) -> list[int]:
        """Completed unit ids; raises the S3 error itself when the S3 backend failed the run."""
        try:
            return self._engine.wait(timeout_ms)
        except native.EngineFailure as failure:
            feeder = self._feeder
            if failure.info.code == native.ERR_EXTERNAL and feeder is not None and feeder.error is not None:
                raise feeder.error from None
            raise

    def stats(self) -> dict[str, float]:
        stats = self._engine.stats()
        if self._client is not None:  # this run's share of the shared client's counters
            stats["requests"] = self._client.requests - self._counted[0]
            stats["retries"] = self._client.retries - self._counted[1]
            stats["bytes_fetched"] = self._client.bytes_fetched - self._counted[2]
        return stats

    def cancel(self) -> None:
        self._engine.cancel()

    def close(self) -> None:
        """Stops S3 requests first (they write into buffers the run owns), then the engine. Idempotent."""
        feeder, self._feeder = self._feeder, None
        try:
            if feeder is not None:
                feeder.close()
        finally:
            self._engine.close()

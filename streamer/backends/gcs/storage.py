"""GCS as a storage: ``gs://bucket/key.safetensors``, ``gs://bucket/prefix/`` and
``gs://bucket/.../*.index.json``, resolved and read by the shared object storage
(``backends/http/storage.py``) with GCS's client (``client.py``), each object read whole checked
against its CRC32C (``crc32c.py``) unless ``GCSConfig.verify_crc32c`` is off."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from streamer.backends import base
from streamer.backends.gcs.client import GcsClient
from streamer.backends.gcs.crc32c import Mismatch, ObjectChecks
from streamer.backends.gcs.uri import GcsObject, GcsUri
from streamer.backends.http.client import Fatal
from streamer.backends.http.feeder import LandedCheck
from streamer.backends.http.objects import StoredObject
from streamer.backends.http.storage import ObjectStorage, stored_object
from streamer.backends.sources import SourceLike
from streamer.config import GCSConfig, StreamerConfig
from streamer.engine import native
from streamer.errors import ObjectStoreError


class GcsStorage(ObjectStorage[GcsClient]):
    """A GCS endpoint as ``config`` describes it; one client, shared by the handle's runs."""

    config: GCSConfig
    store = "gcs"

    def __init__(self, config: GCSConfig) -> None:
        super().__init__(lambda: GcsClient(config))
        self.config = config
        self._checks = ObjectChecks()

    def open(self, source: SourceLike) -> base.Opened:
        opened = super().open(source)
        if self.config.verify_crc32c:
            for front in opened.fronts:
                self._checks.expect(stored_object(front.file), front.data)
        return opened

    def read_ranges(self, ranges: Sequence[base.Range]) -> list[bytes]:
        got = super().read_ranges(ranges)
        for (file, begin, _), data in zip(ranges, got, strict=True):
            obj = stored_object(file)
            if self._checks.checks(obj):
                try:
                    self._checks.add(obj, begin, begin + len(data), native.crc32c(data))
                except Mismatch as mismatch:
                    raise ObjectStoreError(
                        mismatch.reason, bucket=obj.uri.bucket, key=obj.uri.key, scheme=obj.uri.scheme
                    ) from None
        return got

    def landed_check(self) -> LandedCheck | None:
        return self._landed if self.config.verify_crc32c else None

    async def _landed(self, obj: StoredObject, begin: int, end: int, address: int) -> None:
        if not self._checks.checks(obj):
            return
        computing = asyncio.get_running_loop().run_in_executor(None, native.crc32c, address, end - begin)
        try:
            crc = await asyncio.shield(computing)
        except asyncio.CancelledError:
            while not computing.done():  # a cancelled run must not free memory the thread still reads
                try:
                    await asyncio.wait([computing])
                except asyncio.CancelledError:
                    continue
            raise
        try:
            if self._checks.add(obj, begin, end, crc):
                self.client().checked_objects += 1
        except Mismatch as mismatch:
            raise Fatal(mismatch.reason) from None

    def place(self, source: SourceLike) -> str:
        return f"gs {self.config.endpoint}"

    def stored(self, bucket: str, key: str, size: int, version: str | None) -> GcsObject:
        return GcsObject(GcsUri(bucket, key), size, version)

    def reads_in_flight(self, config: StreamerConfig) -> int:
        return self.config.concurrency * config.block_size

"""GCS as a storage: ``gs://bucket/key.safetensors``, ``gs://bucket/prefix/`` and
``gs://bucket/.../*.index.json``, resolved and read by the shared object storage
(``backends/http/storage.py``) with GCS's client (``client.py``)."""

from __future__ import annotations

from streamer.backends.gcs.client import GcsClient
from streamer.backends.gcs.uri import GcsObject, GcsUri
from streamer.backends.http.storage import ObjectStorage
from streamer.backends.sources import SourceLike
from streamer.config import GCSConfig, StreamerConfig


class GcsStorage(ObjectStorage[GcsClient]):
    """A GCS endpoint as ``config`` describes it; one client, shared by the handle's runs."""

    config: GCSConfig
    store = "gcs"

    def __init__(self, config: GCSConfig) -> None:
        super().__init__(lambda: GcsClient(config))
        self.config = config

    def place(self, source: SourceLike) -> str:
        return f"gs {self.config.endpoint}"

    def stored(self, bucket: str, key: str, size: int, version: str | None) -> GcsObject:
        return GcsObject(GcsUri(bucket, key), size, version)

    def reads_in_flight(self, config: StreamerConfig) -> int:
        return self.config.concurrency * config.block_size

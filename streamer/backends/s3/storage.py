"""S3 as a storage: ``s3://bucket/key.safetensors``, ``s3://bucket/prefix/`` and
``s3://bucket/.../*.index.json``, resolved and read by the shared object storage
(``backends/http/storage.py``) with S3's client (``client.py``)."""

from __future__ import annotations

from streamer.backends.http.storage import ObjectStorage
from streamer.backends.s3.client import S3Client
from streamer.backends.s3.uri import ObjectInfo, S3Uri
from streamer.backends.sources import SourceLike
from streamer.config import S3Config
from streamer.errors import S3Error


class S3Storage(ObjectStorage[S3Client]):
    """An S3 endpoint as ``config`` describes it; one client, shared by the handle's runs."""

    config: S3Config
    error_type = S3Error
    store = "s3"

    def __init__(self, config: S3Config) -> None:
        super().__init__(lambda: S3Client(config))
        self.config = config

    def place(self, source: SourceLike) -> str | None:
        return self.config.endpoint_url  # None: AWS

    def stored(self, bucket: str, key: str, size: int, version: str | None) -> ObjectInfo:
        return ObjectInfo(S3Uri(bucket, key), size, version)

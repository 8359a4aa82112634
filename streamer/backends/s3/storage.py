"""S3 as a storage: ``s3://bucket/key.safetensors``, ``s3://bucket/prefix/`` and
``s3://bucket/.../*.index.json``, resolved and read by the shared object storage
(``backends/http/storage.py``) with S3's client (``client.py``)."""

from __future__ import annotations

from streamer.backends.base import StoredFile
from streamer.backends.http.storage import ObjectStorage, stored_object
from streamer.backends.s3.client import S3Client
from streamer.backends.s3.uri import ObjectInfo
from streamer.config import S3Config
from streamer.errors import StreamerError


class S3Storage(ObjectStorage[S3Client]):
    """An S3 endpoint as ``config`` describes it; one client, shared by the handle's runs."""

    def __init__(self, config: S3Config) -> None:
        super().__init__(lambda: S3Client(config))
        self.config = config


def s3_object(file: StoredFile) -> ObjectInfo:
    found = stored_object(file)
    if not isinstance(found, ObjectInfo):
        raise StreamerError("not an S3 object", path=file.path)  # a bug: files come from this storage
    return found

"""The clouds' own SDKs reading GCS and Azure Blob checkpoints, the references streamer is
measured against there, and the upload of a generated checkpoint (``s3peers.py`` is S3's):

- ``read``: every byte of every object into fresh anonymous memory, as each SDK reads in
  parallel: google-cloud-storage ``download_as_bytes`` of 16 MiB ranges on N threads, and
  azure-storage-blob ``download_blob(max_concurrency=N).readinto``;
- ``download``: each object to a local file, what people do before ``safetensors.torch.load_file``;
- ``upload``: local files to a prefix (``--synthetic … --upload gs://bucket/prefix/``).

Clients are built from streamer's ``GCSConfig`` and ``AzureConfig`` (themselves defaulting to the
environment: ``STORAGE_EMULATOR_HOST``, ``AZURE_STORAGE_CONNECTION_STRING`` …), so every reader
goes to the same endpoint with the same credentials.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamer.backends.azure.uri import AzureUri
from streamer.backends.gcs.uri import GcsUri
from streamer.backends.http.objects import ObjectUri
from streamer.config import AzureConfig, GCSConfig
from streamer_bench.parallel import on_threads

MiB = 1 << 20
RANGE_BYTES = 16 * MiB  # per GET, as the boto3 reference


def gcs_bucket(config: GCSConfig, name: str) -> Any:
    """A google-cloud-storage bucket at streamer's endpoint (anonymous for an emulator)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    if config.emulated or config.anonymous:
        client = storage.Client(
            project="streamer-bench",
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
            client_options={"api_endpoint": config.endpoint},
        )
    else:
        client = storage.Client(client_options={"api_endpoint": config.endpoint})
    return client.bucket(name)


def azure_container(config: AzureConfig, name: str) -> Any:
    """An azure-storage-blob container client of the account streamer's configuration names."""
    from azure.storage.blob import BlobServiceClient

    from streamer.backends.azure.auth import account_of

    account = account_of(config, None)
    credential: Any = account.sas or (
        {"account_name": account.name, "account_key": account.key} if account.key else None
    )
    if credential is None:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return BlobServiceClient(account.endpoint, credential=credential).get_container_client(name)


def _fresh(size: int) -> mmap.mmap:
    return mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class _Sink:
    """A seekable writable stream over a buffer, for ``readinto``'s parallel chunk writes."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._at = view, 0

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = os.SEEK_SET) -> int:
        self._at = position if whence == os.SEEK_SET else self._at + position
        return self._at

    def tell(self) -> int:
        return self._at

    def write(self, data: bytes) -> int:
        self._view[self._at : self._at + len(data)] = data
        self._at += len(data)
        return len(data)


def read(scheme: str, uris: Sequence[str], connections: int) -> list[mmap.mmap]:
    """Every object of ``uris`` (``gs://`` or Azure) into its own fresh buffer, by the SDK's own
    parallel reads on ``connections`` threads."""
    if scheme == "gs":
        return _gcs_read(uris, connections)
    return [_azure_read(uri, connections) for uri in uris]


def _gcs_read(uris: Sequence[str], connections: int) -> list[mmap.mmap]:
    config = GCSConfig()
    jobs: list[tuple[memoryview, Any, int, int]] = []
    buffers = []
    for uri in uris:
        where = GcsUri.parse(uri)
        blob = gcs_bucket(config, where.bucket).get_blob(where.key)  # its size, as a reader learns it
        buffer = _fresh(blob.size)
        buffers.append(buffer)
        view = memoryview(buffer)
        jobs += [(view, blob, b, min(b + RANGE_BYTES, blob.size)) for b in range(0, blob.size, RANGE_BYTES)]

    def one(job: tuple[memoryview, Any, int, int]) -> None:
        view, blob, begin, end = job
        data = blob.download_as_bytes(start=begin, end=end - 1, checksum=None, raw_download=True)
        if len(data) != end - begin:
            raise OSError(f"{blob.name}: {len(data)} bytes for the range {begin}-{end - 1}")
        view[begin:end] = data

    on_threads(jobs, one, connections)
    return buffers


def _azure_read(uri: str, connections: int) -> mmap.mmap:
    where = AzureUri.parse(uri)
    blob = azure_container(AzureConfig(), where.bucket).get_blob_client(where.key)
    downloader = blob.download_blob(max_concurrency=connections)
    buffer = _fresh(downloader.size)
    downloader.readinto(_Sink(memoryview(buffer)))
    return buffer


def download(scheme: str, uris: Sequence[str], directory: Path) -> list[Path]:
    """Each object to ``directory`` under its base name, one after another (each SDK's own
    download: google-cloud-storage in one stream, azure-storage-blob over its threads)."""
    paths = []
    for uri in uris:
        where = _uri(scheme, uri)
        path = directory / os.path.basename(where.key)
        if scheme == "gs":
            gcs_bucket(GCSConfig(), where.bucket).blob(where.key).download_to_filename(
                str(path), checksum=None
            )
        else:
            blob = azure_container(AzureConfig(), where.bucket).get_blob_client(where.key)
            with open(path, "wb") as file:
                blob.download_blob(max_concurrency=8).readinto(file)
        paths.append(path)
    return paths


def upload(scheme: str, files: Sequence[Path], prefix: str) -> list[str]:
    """Puts ``files`` under the ``gs://`` or ``az://`` prefix (making the bucket or container if it
    is missing); an object already there with the same size is kept. The objects' URIs, in order."""
    where = _uri(scheme, prefix if prefix.endswith("/") else prefix + "/")
    uris = []
    if scheme == "gs":
        bucket = gcs_bucket(GCSConfig(), where.bucket)
        if not bucket.exists():
            bucket.create()
        for path in files:
            key = where.key + path.name
            uris.append(f"gs://{where.bucket}/{key}")
            found = bucket.get_blob(key)
            if found is None or found.size != path.stat().st_size:
                bucket.blob(key, chunk_size=64 * MiB).upload_from_filename(str(path))
        return uris
    container = azure_container(AzureConfig(), where.bucket)
    if not container.exists():
        container.create_container()
    for path in files:
        key = where.key + path.name
        uris.append(f"az://{where.bucket}/{key}")
        blob = container.get_blob_client(key)
        if not blob.exists() or blob.get_blob_properties().size != path.stat().st_size:
            with open(path, "rb") as file:
                blob.upload_blob(file, overwrite=True, max_concurrency=4)
    return uris


def _uri(scheme: str, text: str) -> ObjectUri:
    return GcsUri.parse(text) if scheme == "gs" else AzureUri.parse(text)

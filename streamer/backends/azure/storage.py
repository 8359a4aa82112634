"""Azure Blob as a storage: ``az://container/key.safetensors``, ``az://container/prefix/``,
``az://container/.../*.index.json`` and the same as portal URLs
(``https://<account>.blob.core.windows.net/...``), resolved and read by the shared object storage
(``backends/http/storage.py``) with Azure's client (``client.py``)."""

from __future__ import annotations

from streamer.backends.azure.auth import account_of
from streamer.backends.azure.client import AzureClient
from streamer.backends.azure.uri import AzureBlob, AzureUri, portal_path
from streamer.backends.base import Opened
from streamer.backends.http.storage import ObjectStorage
from streamer.backends.sources import SourceLike, source_texts
from streamer.config import AzureConfig, StreamerConfig
from streamer.errors import SourceError


class AzureStorage(ObjectStorage[AzureClient]):
    """An Azure storage account as ``config`` (or the portal URLs read) names it."""

    config: AzureConfig
    store = "azure"

    def __init__(self, config: AzureConfig) -> None:
        super().__init__(lambda: AzureClient(config, self._account))
        self.config = config
        self._account: str | None = None

    def open(self, source: SourceLike) -> Opened:
        named = _named_account(source)
        if named is not None:
            self._account = named
        return super().open(source)

    def place(self, source: SourceLike) -> str:
        return f"az {account_of(self.config, _named_account(source) or self._account).endpoint}"

    def stored(self, bucket: str, key: str, size: int, version: str | None) -> AzureBlob:
        return AzureBlob(AzureUri(bucket, key), size, version)

    def reads_in_flight(self, config: StreamerConfig) -> int:
        return self.config.concurrency * config.block_size


def _named_account(source: SourceLike) -> str | None:
    """The account the portal URLs of ``source`` name (None: it has none); they must agree."""
    accounts = {portal_path(text)[0] for text in source_texts(source) if text.startswith("https://")}
    if len(accounts) > 1:
        raise SourceError(f"a checkpoint's blobs must be in one storage account, not {sorted(accounts)}")
    return accounts.pop() if accounts else None

"""Azure Blob reads: the shared REST object-store client (``backends/http/rest.py``) with Azure's
part: blob URLs under the account's endpoint, the ETag rule (``If-Match`` on every data GET, and
the ETag of every answer compared with the one the header read saw), Azure's statuses and error
codes (``ServerBusy``, ``BlobNotFound``, ...) and XML listings. azure-identity and the
Azure SDK's SAS helper are imported only when a client is made."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from urllib.parse import quote, urlencode

from streamer.backends.azure.auth import Authorization, account_of
from streamer.backends.azure.uri import AzureBlob, AzureUri
from streamer.backends.http.client import Fatal, Retry
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.rest import RestObjectClient
from streamer.backends.optional import require_azure
from streamer.config import AzureConfig
from streamer.errors import ObjectSourceError


class AzureClient(RestObjectClient):
    """One Azure storage account's blob endpoint, as ``config`` and the source describe it."""

    uri_type = AzureUri
    changed = "the blob changed during the load (its ETag or size is not the header's)"
    retry_codes = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})
    missing_codes = frozenset({"BlobNotFound", "ContainerNotFound", "ResourceNotFound"})

    def __init__(self, config: AzureConfig, account: str | None) -> None:
        require_azure()
        super().__init__(config, "azure", config.concurrency, config.header_bytes)
        self.config = config
        try:
            self.account = account_of(config, account)
            self._authorization = Authorization(self.account, anonymous=config.anonymous)
        except BaseException:
            self.close()
            raise

    def object_url(self, uri: ObjectUri, version: str | None) -> str:
        return f"{self.account.endpoint}/{quote(uri.bucket, safe='')}/{quote(uri.key)}"

    async def authorization(self, uri: ObjectUri, url: str) -> tuple[dict[str, str], str]:
        return await self._authorization.for_container(uri.bucket)

    def version_from(self, headers: Mapping[str, str]) -> str | None:
        return headers.get("etag")

    def identity_headers(self, obj: StoredObject) -> dict[str, str]:
        return {"If-Match": obj.version} if obj.version else {}

    def verify(self, obj: StoredObject, headers: Mapping[str, str]) -> bool:
        """Refuses an answer from another version of the blob (every answer carries its ETag)."""
        got = headers.get("etag")
        if got is None or obj.version is None:
            raise Fatal("the server sent no ETag, so the blob's version cannot be verified")
        if got.strip() != obj.version.strip():
            raise Fatal(self.changed)
        return True

    def classify(self, exc: Exception) -> Retry | Fatal:
        from azure.core.exceptions import ClientAuthenticationError

        if isinstance(exc, ClientAuthenticationError):
            return Fatal(
                "no Azure credentials: DefaultAzureCredential found none (set AZURE_STORAGE_KEY, "
                "AZURE_STORAGE_SAS_TOKEN or AZURE_STORAGE_CONNECTION_STRING, sign in with the Azure CLI, or "
                "run with a managed or workload identity)"
            )
        return super().classify(exc)

    def token_refused(self) -> None:
        self._authorization.refused()

    def missing(self, code: str | None) -> str:
        return "container" if code == "ContainerNotFound" else "blob"

    def error_code(self, headers: Mapping[str, str], body: bytes) -> str | None:
        code = headers.get("x-ms-error-code")
        return code.strip()[:64] if code else None

    def bucket_missing(self, error: ObjectSourceError) -> bool:
        return error.code == "ContainerNotFound"

    def stored(self, uri: ObjectUri, size: int, version: str | None) -> AzureBlob:
        return AzureBlob(uri, size, version)

    def list_page_url(self, bucket: str, prefix: str, token: str | None) -> str:
        query = {"restype": "container", "comp": "list", "prefix": prefix, "delimiter": "/"}
        if token:
            query["marker"] = token
        return f"{self.account.endpoint}/{quote(bucket, safe='')}?{urlencode(query)}"

    def parse_page(self, body: bytes) -> tuple[list[str], str | None]:
        return _listing(body)


def _listing(body: bytes) -> tuple[list[str], str | None]:
    """The blob names of an ``EnumerationResults`` page and its ``NextMarker`` (None at the end)."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        raise Retry("the listing is not XML") from None
    names = [name.text for name in root.iterfind("./Blobs/Blob/Name") if name.text]
    marker = root.findtext("NextMarker")
    return names, marker or None

"""Azure Blob reads: the shared REST object-store client (``backends/http/rest.py``) with Azure's
part: blob URLs under the account's endpoint, the ETag rule (``If-Match`` on every data GET, and
the ETag of every answer compared with the one the header read saw), Azure's statuses and error
codes (``ServerBusy``, ``BlobNotFound``, ...) and XML listings. aiohttp, azure-identity and the
Azure SDK's SAS helper are imported only when a client is made."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from urllib.parse import quote, urlencode

from streamer.backends.azure.auth import Authorization, account_of
from streamer.backends.azure.uri import AzureBlob, AzureUri
from streamer.backends.http.client import Fatal, Retry
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.rest import RETRYABLE_STATUS, RestObjectClient
from streamer.backends.http.timing import LowSpeed
from streamer.backends.optional import require_azure
from streamer.config import AzureConfig
from streamer.errors import ObjectSourceError

_LIST_PAGE_BYTES = 8 << 20  # a listing page's size bound (5000 names), for its attempt deadline
_RETRYABLE_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})
_MISSING_CODES = frozenset({"BlobNotFound", "ContainerNotFound", "ResourceNotFound"})


class AzureClient(RestObjectClient):
    """One Azure storage account's blob endpoint, as ``config`` and the source describe it."""

    uri_type = AzureUri
    changed = "the blob changed during the load (its ETag or size is not the header's)"

    def __init__(self, config: AzureConfig, account: str | None) -> None:
        require_azure()
        super().__init__(config, "azure", config.concurrency, config.header_bytes)
        self.config = config
        try:
            self.account = account_of(config, account)
            self._authorization = Authorization(self.account, anonymous=config.anonymous)
            self.call(self.open_session(https=self.account.endpoint.startswith("https")))
        except BaseException:
            self.close()
            raise

    def object_url(self, uri: ObjectUri, version: str | None) -> str:
        return f"{self.account.endpoint}/{quote(uri.bucket, safe='')}/{quote(uri.key)}"

    async def authorization(self, uri: ObjectUri) -> tuple[dict[str, str], str]:
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

    def classify_status(self, status: int, code: str | None) -> Retry | Fatal:
        if status == 401:
            self._authorization.refused()
            return Retry("the token was refused (refreshed for the next try)", status, code)
        if status in RETRYABLE_STATUS or status >= 500 or code in _RETRYABLE_CODES:
            return Retry("the server asked to retry", status, code)
        if status == 412 or code == "ConditionNotMet":
            return Fatal(self.changed, status, code)
        if status == 404 or code in _MISSING_CODES:
            what = "container" if code == "ContainerNotFound" else "blob"
            return Fatal(f"no such {what}", status, code)
        if status == 403:
            return Fatal("access denied", status, code)
        if 200 <= status < 300:
            return Retry("an unusable response (not the range asked for)", status, code)
        return Fatal("request refused", status, code)

    def error_code(self, headers: Mapping[str, str], body: bytes) -> str | None:
        code = headers.get("x-ms-error-code")
        return code.strip()[:64] if code else None

    def bucket_missing(self, error: ObjectSourceError) -> bool:
        return error.code == "ContainerNotFound"

    def stored(self, uri: ObjectUri, size: int, version: str | None) -> AzureBlob:
        return AzureBlob(uri, size, version)

    async def empty_object(self, uri: ObjectUri, speed: LowSpeed) -> AzureBlob:
        """An empty blob: a GET without a range answers 200 with its ETag and no body."""
        _, headers, body = await self.get(uri, self.object_url(uri, None), {}, 16, speed)
        if body:
            raise Retry("the blob is not empty any more")
        blob = AzureBlob(uri, 0, self.version_from(headers))
        self.verify(blob, headers)
        return blob

    async def list_keys(self, bucket: str, prefix: str) -> list[str]:
        """Blob names directly under ``prefix`` (not in virtual "directories"), sorted; a marker seen
        before, or more than ``max_list_pages`` pages, is an error."""
        keys: list[str] = []
        marker: str | None = None
        seen: set[str] = set()
        uri = AzureUri(bucket, prefix)
        for _ in range(self.config.max_list_pages):
            query = {"restype": "container", "comp": "list", "prefix": prefix, "delimiter": "/"}
            if marker:
                query["marker"] = marker
            url = f"{self.account.endpoint}/{quote(bucket, safe='')}?{urlencode(query)}"

            async def once(speed: LowSpeed, url: str = url) -> tuple[list[str], str | None]:
                _, _, body = await self.get(uri, url, {}, _LIST_PAGE_BYTES, speed)
                if len(body) > _LIST_PAGE_BYTES:
                    raise Fatal("a listing page of more than 8 MiB")
                return _listing(body)

            names, marker = await self.retrying(uri, None, once, nbytes=_LIST_PAGE_BYTES, source_errors=True)
            keys.extend(names)
            if not marker:
                return sorted(keys)
            if marker in seen:
                raise self.source_error("the listing repeats a marker: it would never end", uri)
            seen.add(marker)
        raise self.source_error(
            f"the listing has more than {self.config.max_list_pages} pages (AzureConfig.max_list_pages)", uri
        )


def _listing(body: bytes) -> tuple[list[str], str | None]:
    """The blob names of an ``EnumerationResults`` page and its ``NextMarker`` (None at the end)."""
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        raise Retry("the listing is not XML") from None
    names = [name.text for name in root.iterfind("./Blobs/Blob/Name") if name.text]
    marker = root.findtext("NextMarker")
    return names, marker or None

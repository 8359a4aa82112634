"""Azure Blob URIs: ``az://container/key`` (the account from the configuration) and the URL the
portal shows, ``https://<account>.blob.core.windows.net/<container>/<key>``; blobs pinned to an ETag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import unquote, urlsplit

from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.errors import SourceError

PORTAL_SUFFIX = ".blob.core.windows.net"


@dataclass(frozen=True)
class AzureUri(ObjectUri):
    """A blob: ``bucket`` is its container."""

    scheme: ClassVar[str] = "az"
    label: ClassVar[str] = "Azure Blob"

    @classmethod
    def parse(cls, text: str) -> ObjectUri:
        if not text.startswith("https://"):
            return super().parse(text)
        return super().parse(f"az://{portal_path(text)[1]}")


def portal_path(url: str) -> tuple[str, str]:
    """``(account, "container/key")`` of a portal URL; ``SourceError`` for any other https URL."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme != "https" or not host.endswith(PORTAL_SUFFIX) or host == PORTAL_SUFFIX[1:]:
        raise SourceError(
            f"https:// sources are Azure Blob URLs (https://<account>{PORTAL_SUFFIX}/<container>/<key>)",
            path=url,
        )
    if parts.query or parts.fragment:
        raise SourceError("an Azure Blob URL with a query: give a SAS in AzureConfig.sas_token", path=url)
    return host[: -len(PORTAL_SUFFIX)], unquote(parts.path.lstrip("/"))


@dataclass(frozen=True)
class AzureBlob(StoredObject):
    """A blob as its header read saw it: its version is its ETag."""

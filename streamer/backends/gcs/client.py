"""GCS reads: the shared REST object-store client (``backends/http/rest.py``) with GCS's part:
the JSON API's media URLs pinned to a generation, the generation rule (every answer's
``x-goog-generation`` is the one the header read saw), GCS's statuses and JSON listings, and
bearer tokens from google-auth. google-auth is imported only when a client is made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from streamer.backends.gcs.auth import Tokens
from streamer.backends.gcs.crc32c import crc32c_from
from streamer.backends.gcs.uri import GcsObject, GcsUri
from streamer.backends.http.client import Fatal, Retry
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.rest import RestObjectClient
from streamer.backends.http.timing import LowSpeed
from streamer.backends.optional import require_gcs
from streamer.config import GCSConfig
from streamer.errors import ObjectSourceError


class GcsClient(RestObjectClient):
    """A GCS endpoint as ``config`` describes it."""

    uri_type = GcsUri
    changed = "the object changed during the load (its generation or size is not the header's)"

    def __init__(self, config: GCSConfig) -> None:
        require_gcs()
        super().__init__(config, "gcs", config.concurrency, config.header_bytes)
        self.config = config
        self._endpoint = config.endpoint
        try:
            self._tokens = Tokens(anonymous=config.anonymous or config.emulated)
        except BaseException:
            self.close()
            raise

    def object_url(self, uri: ObjectUri, version: str | None) -> str:
        pinned = f"&generation={version}" if version else ""
        return f"{self._endpoint}{_gcs(uri).object_path}?alt=media{pinned}"

    async def authorization(self, uri: ObjectUri, url: str) -> tuple[dict[str, str], str]:
        return await self._tokens.header(), ""

    def version_from(self, headers: Mapping[str, str]) -> str | None:
        found = headers.get("x-goog-generation")
        return found.strip() if found and found.strip().isdigit() else None

    def identity_headers(self, obj: StoredObject) -> dict[str, str]:
        return {}  # the generation is in the URL: another generation is a 404

    def verify(self, obj: StoredObject, headers: Mapping[str, str]) -> bool:
        """Refuses an answer from another generation; True when it proved its generation."""
        got = headers.get("x-goog-generation")
        if got is not None and obj.version is not None:
            if got.strip() != obj.version:
                raise Fatal(self.changed)
            return True
        if self.config.require_generation:
            raise Fatal(
                "the server sent no generation (x-goog-generation), so the object's version cannot be "
                "verified (GCSConfig.require_generation=False accepts that risk)"
            )
        return False

    def classify(self, exc: Exception) -> Retry | Fatal:
        import google.auth.exceptions as ge

        if isinstance(exc, ge.RefreshError):
            return Fatal(f"the credentials were refused when refreshing a token: {type(exc).__name__}")
        if isinstance(exc, ge.TransportError):
            return Retry(f"token refresh failed: {type(exc).__name__}")
        return super().classify(exc)

    def token_refused(self) -> None:
        self._tokens.refused()

    def missing(self, code: str | None) -> str:
        return "bucket" if code == "bucketNotFound" else "object (or generation)"

    def error_code(self, headers: Mapping[str, str], body: bytes) -> str | None:
        """GCS's reason for an error (``notFound``, ``forbidden``; ``bucketNotFound`` where the
        message says the bucket is missing), from its JSON error body."""
        try:
            error = json.loads(body).get("error", {})
        except (ValueError, AttributeError):
            return None
        if not isinstance(error, dict):
            return None
        if "bucket" in str(error.get("message", "")).lower() and error.get("code") == 404:
            return "bucketNotFound"
        errors = error.get("errors")
        if isinstance(errors, list) and errors and isinstance(errors[0], dict) and errors[0].get("reason"):
            return str(errors[0]["reason"])[:64]
        return None

    def bucket_missing(self, error: ObjectSourceError) -> bool:
        return error.code == "bucketNotFound"

    def stored(self, uri: ObjectUri, size: int, version: str | None) -> GcsObject:
        return GcsObject(uri, size, version)

    def answered(self, uri: ObjectUri, size: int, headers: Mapping[str, str]) -> GcsObject:
        return GcsObject(uri, size, self.version_from(headers), crc32c_from(headers))

    async def empty_object(self, uri: ObjectUri, speed: LowSpeed) -> GcsObject:
        """An empty object, with its generation from its metadata."""
        url = f"{self._endpoint}{_gcs(uri).object_path}?fields=generation,size"
        _, _, body = await self.get(uri, url, {}, 64 << 10, speed)
        fields = _json(body)
        if str(fields.get("size", "")) != "0":
            raise Retry("the object is not empty any more")
        generation = fields.get("generation")
        obj = GcsObject(uri, 0, str(generation) if generation is not None else None)
        self.verify(obj, {} if generation is None else {"x-goog-generation": str(generation)})
        return obj

    def list_page_url(self, bucket: str, prefix: str, token: str | None) -> str:
        query = {"prefix": prefix, "delimiter": "/", "fields": "items(name),nextPageToken"}
        if token:
            query["pageToken"] = token
        return f"{self._endpoint}{GcsUri(bucket, prefix).bucket_path}?{urlencode(query)}"

    def parse_page(self, body: bytes) -> tuple[list[str], str | None]:
        page = _json(body)
        items = page.get("items", [])
        names = [
            item["name"] for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
        token = page.get("nextPageToken")
        return names, token if isinstance(token, str) and token else None


def _gcs(uri: ObjectUri) -> GcsUri:
    if not isinstance(uri, GcsUri):
        raise TypeError(f"not a GCS URI: {uri}")  # a bug: names come from this client
    return uri


def _json(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError:
        raise Retry("the server's JSON answer does not parse") from None
    if not isinstance(parsed, dict):
        raise Retry("the server's JSON answer is not an object")
    return parsed

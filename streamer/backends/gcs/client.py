"""GCS reads: the shared REST object-store client (``backends/http/rest.py``) with GCS's part:
the JSON API's media URLs pinned to a generation, the generation rule (every answer's
``x-goog-generation`` is the one the header read saw), GCS's statuses and JSON listings, and
bearer tokens from google-auth. aiohttp and google-auth are imported only when a client is made.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

from streamer.backends.gcs.auth import Tokens
from streamer.backends.gcs.uri import GcsObject, GcsUri
from streamer.backends.http.client import Fatal, Retry
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.rest import RETRYABLE_STATUS, RestObjectClient
from streamer.backends.http.timing import LowSpeed
from streamer.backends.optional import require_gcs
from streamer.config import GCSConfig
from streamer.errors import ObjectSourceError

_LIST_PAGE_BYTES = 4 << 20  # a listing page's size bound (1000 names), for its attempt deadline


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
            self.call(self.open_session(https=self._endpoint.startswith("https")))
        except BaseException:
            self.close()
            raise

    def object_url(self, uri: ObjectUri, version: str | None) -> str:
        pinned = f"&generation={version}" if version else ""
        return f"{self._endpoint}{_gcs(uri).object_path}?alt=media{pinned}"

    async def authorization(self, uri: ObjectUri) -> tuple[dict[str, str], str]:
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

    def classify_status(self, status: int, code: str | None) -> Retry | Fatal:
        if status == 401:
            self._tokens.refused()
            return Retry("the token was refused (refreshed for the next try)", status, code)
        if status in RETRYABLE_STATUS or status >= 500:
            return Retry("the server asked to retry", status, code)
        if status == 412:
            return Fatal(self.changed, status, code)
        if status == 404:
            what = "bucket" if code == "bucketNotFound" else "object (or generation)"
            return Fatal(f"no such {what}", status, code)
        if status == 403:
            return Fatal("access denied", status, code)
        if 200 <= status < 300:
            return Retry("an unusable response (not the range asked for)", status, code)
        return Fatal("request refused", status, code)

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

    async def list_keys(self, bucket: str, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (not in sub-"directories"), sorted; a page token seen
        before, or more than ``max_list_pages`` pages, is an error."""
        keys: list[str] = []
        token: str | None = None
        seen: set[str] = set()
        uri = GcsUri(bucket, prefix)
        for _ in range(self.config.max_list_pages):
            query = {"prefix": prefix, "delimiter": "/", "fields": "items(name),nextPageToken"}
            if token:
                query["pageToken"] = token
            url = f"{self._endpoint}{uri.bucket_path}?{urlencode(query)}"

            async def once(speed: LowSpeed, url: str = url) -> dict[str, Any]:
                _, _, body = await self.get(uri, url, {}, _LIST_PAGE_BYTES, speed)
                if len(body) > _LIST_PAGE_BYTES:
                    raise Fatal("a listing page of more than 4 MiB")
                return _json(body)

            page = await self.retrying(uri, None, once, nbytes=_LIST_PAGE_BYTES, source_errors=True)
            for item in page.get("items", []):
                name = item.get("name") if isinstance(item, dict) else None
                if isinstance(name, str):
                    keys.append(name)
            token = page.get("nextPageToken")
            if not isinstance(token, str) or not token:
                return sorted(keys)
            if token in seen:
                raise self.source_error("the listing repeats a page token: it would never end", uri)
            seen.add(token)
        raise self.source_error(
            f"the listing has more than {self.config.max_list_pages} pages (GCSConfig.max_list_pages)", uri
        )


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

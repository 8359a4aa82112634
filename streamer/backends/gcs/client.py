"""GCS reads: the shared HTTP object-store client (``backends/http/client.py``) with GCS's part of
the contract: the JSON API's media URLs pinned to a generation (``sign``), the generation rule
(``verify``: every answer's ``x-goog-generation`` is the one the header read saw), GCS's failures
(``classify``) and errors naming the ``gs://`` URI (``error``).

The control plane (header fronts, listings, an index) goes through aiohttp on the client's loop,
each request bounded and retried as the data path's are; the data path is the shared client's
own connections. aiohttp and google-auth are imported only when a client is made.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping
from typing import Any

from streamer.backends.gcs.auth import Tokens
from streamer.backends.gcs.uri import GcsObject, GcsUri
from streamer.backends.http.client import Fatal, ObjectStoreClient, Retry
from streamer.backends.http.endpoint import ProxyError, Target, UnsupportedProxy
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.response import HttpFailure, ProtocolViolation, SizeChanged, content_range
from streamer.backends.http.timing import LowSpeed
from streamer.backends.optional import require_gcs
from streamer.config import GCSConfig
from streamer.errors import ObjectMissingError, ObjectSourceError, ObjectStoreError

CHANGED = "the object changed during the load (its generation or size is not the header's)"
_LIST_PAGE_BYTES = 4 << 20  # a listing page's size bound (1000 names), for its attempt deadline
_ERROR_BODY_LIMIT = 64 << 10
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class GcsClient(ObjectStoreClient):
    """A GCS endpoint as ``config`` describes it: one loop thread, one aiohttp session."""

    uri_type = GcsUri

    def __init__(self, config: GCSConfig) -> None:
        require_gcs()
        super().__init__(config, "gcs", config.concurrency)
        self.config = config
        self.header_bytes = config.header_bytes
        self._endpoint = config.endpoint
        self._session: Any = None
        try:
            self._tokens = Tokens(anonymous=config.anonymous or config.emulated)
            self.call(self._open())
        except BaseException:
            self.close()
            raise

    async def _open(self) -> None:
        import aiohttp

        c = self.config
        timeout = aiohttp.ClientTimeout(sock_connect=c.connect_timeout, sock_read=c.read_timeout)
        ssl_option: ssl.SSLContext | bool = self._ssl_context if self._endpoint.startswith("https") else False
        connector = aiohttp.TCPConnector(limit=max(c.concurrency, 1), ssl=ssl_option)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=timeout, trust_env=True, auto_decompress=False
        )

    async def release(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        await asyncio.get_running_loop().shutdown_default_executor()  # token refreshes' thread

    # --- the store's part of the data path ---------------------------------------------------

    async def sign(self, obj: StoredObject) -> tuple[Target, dict[str, str]]:
        uri = _gcs(obj.uri)
        query = "alt=media" + (f"&generation={obj.version}" if obj.version else "")
        return Target.parse(f"{self._endpoint}{uri.object_path}?{query}"), await self._tokens.header()

    def identity_headers(self, obj: StoredObject) -> dict[str, str]:
        return {}  # the generation is in the URL: another generation is a 404

    def verify(self, obj: StoredObject, headers: Mapping[str, str]) -> bool:
        """Refuses an answer from another generation; True when it proved its generation."""
        got = headers.get("x-goog-generation")
        if got is not None and obj.version is not None:
            if got.strip() != obj.version:
                raise Fatal(CHANGED)
            return True
        if self.config.require_generation:
            raise Fatal(
                "the server sent no generation (x-goog-generation), so the object's version cannot be "
                "verified (GCSConfig.require_generation=False accepts that risk)"
            )
        return False

    def classify(self, exc: Exception) -> Retry | Fatal:
        import aiohttp
        import google.auth.exceptions as ge

        if isinstance(exc, (Retry, Fatal)):
            return exc
        if isinstance(exc, HttpFailure):
            return self._classify_status(exc.status, exc.code)
        if isinstance(exc, ProtocolViolation):
            return Fatal(str(exc)) if exc.fatal else Retry(str(exc))
        if isinstance(exc, SizeChanged):
            return Fatal(f"{CHANGED}: {exc}")
        if isinstance(exc, ProxyError):
            return Retry(str(exc), exc.status) if exc.status >= 500 else Fatal(str(exc), exc.status)
        if isinstance(exc, UnsupportedProxy):
            return Fatal(str(exc))
        if isinstance(exc, ge.RefreshError):
            return Fatal(f"the credentials were refused when refreshing a token: {type(exc).__name__}")
        if isinstance(exc, ge.TransportError):
            return Retry(f"token refresh failed: {type(exc).__name__}")
        if isinstance(exc, ssl.SSLCertVerificationError):
            return Fatal(f"TLS failure: {type(exc).__name__}")
        if isinstance(
            exc, (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError, OSError)
        ):
            return Retry(f"connection failure: {type(exc).__name__}")
        return Fatal(f"unexpected failure: {type(exc).__name__}: {exc}")

    def _classify_status(self, status: int, code: str | None) -> Retry | Fatal:
        if status == 401:
            self._tokens.refused()
            return Retry("the token was refused (refreshed for the next try)", status, code)
        if status in _RETRYABLE_STATUS or status >= 500:
            return Retry("the server asked to retry", status, code)
        if status == 412:
            return Fatal(CHANGED, status, code)
        if status == 404:
            what = "bucket" if code == "bucketNotFound" else "object (or generation)"
            return Fatal(f"no such {what}", status, code)
        if status == 403:
            return Fatal("access denied", status, code)
        if 300 <= status < 400:
            return Fatal("redirected: GCSConfig.endpoint_url should name the endpoint itself", status, code)
        if 200 <= status < 300:
            return Retry("an unusable response (not the range asked for)", status, code)
        return Fatal("request refused", status, code)

    def error_type(self, failure: Retry | Fatal, *, source_errors: bool) -> type[ObjectStoreError]:
        gone = source_errors and failure.status in (401, 403, 404, 301, 302, 303, 307, 308)
        if gone and failure.status == 404:
            return ObjectMissingError
        return ObjectSourceError if gone else ObjectStoreError

    def bucket_missing(self, error: ObjectSourceError) -> bool:
        return error.code == "bucketNotFound"

    def source_error(self, message: str, uri: ObjectUri) -> ObjectSourceError:
        return ObjectSourceError(message, bucket=uri.bucket, key=uri.key, scheme=GcsUri.scheme)

    # --- the control plane -------------------------------------------------------------------

    async def _get(
        self, url: str, headers: Mapping[str, str], limit: int, speed: LowSpeed
    ) -> tuple[int, dict[str, str], bytes]:
        """One GET through the session: status, headers (lower-case names) and at most ``limit``
        body bytes; an error status is an ``HttpFailure`` with GCS's reason as its code."""
        self.requests += 1
        request = {**headers, **(await self._tokens.header()), "Accept-Encoding": "identity"}
        async with self._session.get(url, headers=request, allow_redirects=False) as response:
            got = {name.lower(): value for name, value in response.headers.items()}
            if response.status >= 300:
                body = await response.content.read(_ERROR_BODY_LIMIT)
                raise HttpFailure(response.status, _reason(body), got)
            encoding = got.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise Fatal(f"the server encoded the body (Content-Encoding: {encoding[:40]})")
            data = bytearray()
            while len(data) <= limit:
                chunk = await response.content.read(min(1 << 20, limit + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
                speed.moved += len(chunk)
            self.bytes_fetched += len(data)
            return response.status, got, bytes(data)

    async def get_start(self, uri: ObjectUri, length: int) -> tuple[bytes, GcsObject]:
        """Up to ``length`` bytes from the start of the object, with its size and generation (one GET)."""
        url = f"{self._endpoint}{_gcs(uri).object_path}?alt=media"

        async def once(speed: LowSpeed) -> tuple[bytes, GcsObject]:
            try:
                status, headers, data = await self._get(
                    url, {"Range": f"bytes=0-{length - 1}"}, length, speed
                )
            except HttpFailure as failure:
                if failure.status != 416:
                    raise
                return b"", await self._empty(uri, speed)  # an empty object has no byte 0
            span = content_range(headers.get("content-range"))
            if status == 206 and span is not None:
                size = span[2]
                if span[:2] != (0, min(length, size) - 1):
                    raise Retry(f"the server sent bytes {span[0]}-{span[1]}, not 0-{min(length, size) - 1}")
            elif status == 200:
                size = len(data)  # the whole object: a server may answer a range covering it so
                if size > length:
                    raise Retry("the server ignored the byte range")
            else:
                raise Retry(f"an HTTP {status} without a valid Content-Range")
            if len(data) != min(length, size):
                raise Retry(f"short body: {len(data)} of {min(length, size)} bytes")
            obj = GcsObject(uri, size, _generation(headers))
            self.verify(obj, headers)
            return data, obj

        return await self.retrying(uri, (0, length), once, nbytes=length, source_errors=True)

    async def _empty(self, uri: ObjectUri, speed: LowSpeed) -> GcsObject:
        """An empty object, with its generation from its metadata."""
        url = f"{self._endpoint}{_gcs(uri).object_path}?fields=generation,size"
        _, _, body = await self._get(url, {}, 64 << 10, speed)
        fields = _json(body)
        if str(fields.get("size", "")) != "0":
            raise Retry("the object is not empty any more")
        generation = fields.get("generation")
        obj = GcsObject(uri, 0, str(generation) if generation is not None else None)
        self.verify(obj, {} if generation is None else {"x-goog-generation": str(generation)})
        return obj

    async def get_object(self, uri: ObjectUri, limit: int) -> bytes:
        """A whole small object, e.g. an index file; ``ObjectSourceError`` when it is over ``limit``."""
        data, obj = await self.get_start(uri, min(limit, 1 << 20))
        if obj.size > limit:
            raise self.source_error(f"the object is {obj.size} bytes, more than the limit of {limit}", uri)
        if obj.size > len(data):
            data += await self.get_bytes(obj, len(data), obj.size, source_errors=True)
        return data

    async def list_keys(self, bucket: str, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (not in sub-"directories"), sorted; a page token seen
        before, or more than ``max_list_pages`` pages, is an error."""
        keys: list[str] = []
        token: str | None = None
        seen: set[str] = set()
        uri = GcsUri(bucket, prefix)
        base = f"{self._endpoint}{uri.bucket_path}"
        for _ in range(self.config.max_list_pages):
            query = {"prefix": prefix, "delimiter": "/", "fields": "items(name),nextPageToken"}
            if token:
                query["pageToken"] = token

            async def once(speed: LowSpeed, query: dict[str, str] = query) -> dict[str, Any]:
                from urllib.parse import urlencode

                _, _, body = await self._get(f"{base}?{urlencode(query)}", {}, _LIST_PAGE_BYTES, speed)
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


def _generation(headers: Mapping[str, str]) -> str | None:
    found = headers.get("x-goog-generation")
    return found.strip() if found and found.strip().isdigit() else None


def _json(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError:
        raise Retry("the server's JSON answer does not parse") from None
    if not isinstance(parsed, dict):
        raise Retry("the server's JSON answer is not an object")
    return parsed


def _reason(body: bytes) -> str | None:
    """GCS's reason for an error (``notFound``, ``forbidden``; ``bucketNotFound`` where the
    message says the bucket is missing), from its JSON error body."""
    try:
        error = json.loads(body).get("error", {})
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    message = str(error.get("message", ""))
    if "bucket" in message.lower() and error.get("code") == 404:
        return "bucketNotFound"
    errors = error.get("errors")
    if isinstance(errors, list) and errors and isinstance(errors[0], dict):
        reason = errors[0].get("reason")
        return str(reason)[:64] if reason else None
    return None

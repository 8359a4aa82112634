"""The control plane of a store spoken to as plain REST (S3, GCS's JSON API, Azure Blob): header
fronts, small objects and listing pages through the shared client's own keep-alive connections,
each request bounded and retried as the data path's are, and what a failure of either means.

A store subclasses ``RestObjectClient`` and supplies: its object URL (``object_url``), the headers
and query that authorise a request (``authorization``), the version an answer names
(``version_from``), what an empty object is (``empty_object``, where a GET without a range does
not say), what a status means
(``classify_status``) and a listing (``list_page_url``, ``parse_page``).
"""

from __future__ import annotations

import abc
import asyncio
import ssl
from collections.abc import Mapping

from streamer.backends.http.client import Fatal, ObjectStoreClient, Retry, RetrySettings
from streamer.backends.http.endpoint import ProxyError, Target, UnsupportedProxy
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.response import (
    HttpFailure,
    ProtocolViolation,
    SizeChanged,
    content_range,
    xml_error_fields,
)
from streamer.backends.http.timing import LowSpeed
from streamer.errors import ObjectMissingError, ObjectSourceError, ObjectStoreError

ERROR_BODY_LIMIT = 64 << 10
LIST_PAGE_BYTES = 8 << 20  # a listing page's size bound (GCS: 1000 names, Azure: 5000), its deadline
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class RestObjectClient(ObjectStoreClient):
    """A REST object store's client: one loop thread, its connections, the shared data path."""

    changed = "the object changed during the load (its version or size is not the header's)"

    def __init__(self, settings: RetrySettings, store: str, concurrency: int, header_bytes: int) -> None:
        super().__init__(settings, store, concurrency)
        self.header_bytes = header_bytes

    async def release(self) -> None:
        await asyncio.get_running_loop().shutdown_default_executor()  # token refreshes' thread

    # --- what a REST store supplies ----------------------------------------------------------

    @abc.abstractmethod
    def object_url(self, uri: ObjectUri, version: str | None) -> str:
        """The URL a GET of the object's bytes goes to (pinned to ``version`` where the URL can say it)."""

    @abc.abstractmethod
    async def authorization(self, uri: ObjectUri, url: str) -> tuple[dict[str, str], str]:
        """The headers and the query (``""`` or ``"a=b&..."``) that authorise a GET of ``url`` for
        ``uri`` (an object, or a prefix being listed) now."""

    @abc.abstractmethod
    def version_from(self, headers: Mapping[str, str]) -> str | None:
        """The object version an answer's headers name (None: it names none)."""

    async def empty_object(self, uri: ObjectUri, speed: LowSpeed) -> StoredObject:
        """An empty object (a ranged GET of it is a 416), with its version: by default a GET
        without a range, which answers 200, no body and the object's version."""
        _, headers, body = await self.get(uri, self.object_url(uri, None), {}, 16, speed)
        if body:
            raise Retry("the object is not empty any more")
        obj = self.answered(uri, 0, headers)
        self.verify(obj, headers)
        return obj

    @abc.abstractmethod
    def token_refused(self) -> None:
        """The server refused the credentials (401): refresh them before the next try."""

    @abc.abstractmethod
    def missing(self, code: str | None) -> str:
        """What a 404 with the store's ``code`` says is missing ("bucket", "blob", ...)."""

    retry_codes: frozenset[str] = frozenset()  # the store's codes that say "try again"
    missing_codes: frozenset[str] = frozenset()  # ... that say the object or its bucket is gone

    def classify_status(self, status: int, code: str | None) -> Retry | Fatal:
        """What an error status (and the store's error code) means."""
        if status == 401:
            self.token_refused()
            return Retry("the credentials were refused (refreshed for the next try)", status, code)
        if status in RETRYABLE_STATUS or status >= 500 or code in self.retry_codes:
            return Retry("the server asked to retry", status, code)
        if status == 412:
            return Fatal(self.changed, status, code)
        if status == 404 or code in self.missing_codes:
            return Fatal(f"no such {self.missing(code)}", status, code)
        if status == 403:
            return Fatal("access denied", status, code)
        if 200 <= status < 300:
            return Retry("an unusable response (not the range asked for)", status, code)
        return Fatal("request refused", status, code)

    @abc.abstractmethod
    def list_page_url(self, bucket: str, prefix: str, token: str | None) -> str:
        """The URL of one listing page of the names directly under ``prefix`` (``token``: the
        page the last one pointed to)."""

    @abc.abstractmethod
    def parse_page(self, body: bytes) -> tuple[list[str], str | None]:
        """A listing page's names and the token of the next page (None at the end)."""

    @abc.abstractmethod
    def stored(self, uri: ObjectUri, size: int, version: str | None) -> StoredObject:
        """The store's object as a header read saw it."""

    def answered(self, uri: ObjectUri, size: int, headers: Mapping[str, str]) -> StoredObject:
        """The object of ``size`` bytes an answer's headers describe (its version, and whatever
        else the store's answers say of it)."""
        return self.stored(uri, size, self.version_from(headers))

    # --- the shared client's hooks -----------------------------------------------------------

    async def sign(self, obj: StoredObject) -> tuple[Target, dict[str, str]]:
        url = self.object_url(obj.uri, obj.version)
        headers, query = await self.authorization(obj.uri, url)
        return Target.parse(_with_query(url, query)), headers

    def classify(self, exc: Exception) -> Retry | Fatal:
        if isinstance(exc, (Retry, Fatal)):
            return exc
        if isinstance(exc, HttpFailure):
            if exc.status in _REDIRECTS:
                return Fatal("redirected: the endpoint should be named itself", exc.status, exc.code)
            return self.classify_status(exc.status, exc.code)
        if isinstance(exc, ProtocolViolation):
            return Fatal(str(exc)) if exc.fatal else Retry(str(exc))
        if isinstance(exc, SizeChanged):
            return Fatal(f"{self.changed}: {exc}")
        if isinstance(exc, ProxyError):
            return Retry(str(exc), exc.status) if exc.status >= 500 else Fatal(str(exc), exc.status)
        if isinstance(exc, UnsupportedProxy):
            return Fatal(str(exc))
        if isinstance(exc, ssl.SSLCertVerificationError):
            return Fatal(f"TLS failure: {type(exc).__name__}")
        if isinstance(exc, (asyncio.TimeoutError, OSError)):
            return Retry(f"connection failure: {type(exc).__name__}")
        # The type alone: a message could quote the request's URL, and a SAS is in its query.
        return Fatal(f"unexpected failure: {type(exc).__name__}")

    def error_type(self, failure: Retry | Fatal, *, source_errors: bool) -> type[ObjectStoreError]:
        gone = source_errors and failure.status in (401, 403, 404, *_REDIRECTS)
        if gone and failure.status == 404:
            return ObjectMissingError
        return ObjectSourceError if gone else ObjectStoreError

    def source_error(self, message: str, uri: ObjectUri) -> ObjectSourceError:
        return ObjectSourceError(message, bucket=uri.bucket, key=uri.key, scheme=uri.scheme)

    # --- the control plane -------------------------------------------------------------------

    async def get(
        self, uri: ObjectUri, url: str, headers: Mapping[str, str], limit: int, speed: LowSpeed
    ) -> tuple[int, dict[str, str], bytes]:
        """One GET authorised for ``uri``: status, headers (lower-case names) and at most
        ``limit + 1`` body bytes; an error status is an ``HttpFailure`` with the store's error code."""
        self.requests += 1
        auth, query = await self.authorization(uri, url)
        status, got, data = await self.plain_get(_with_query(url, query), {**headers, **auth}, limit, speed)
        if status >= 300:
            body = data[:ERROR_BODY_LIMIT]
            raise HttpFailure(status, self.error_code(got, body), got, xml_error_fields(body))
        encoding = got.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise Fatal(f"the server encoded the body (Content-Encoding: {encoding[:40]})")
        self.bytes_fetched += len(data)
        return status, got, data

    def error_code(self, headers: Mapping[str, str], body: bytes) -> str | None:
        """The store's code for an error answer (none by default)."""
        return None

    async def get_start(self, uri: ObjectUri, length: int) -> tuple[bytes, StoredObject]:
        """Up to ``length`` bytes from the start of the object, with its size and version (one GET)."""
        url = self.object_url(uri, None)

        async def once(speed: LowSpeed) -> tuple[bytes, StoredObject]:
            try:
                asked = {"Range": f"bytes=0-{length - 1}"}
                status, headers, data = await self.get(uri, url, asked, length, speed)
            except HttpFailure as failure:
                if failure.status != 416:
                    raise
                return b"", await self.empty_object(uri, speed)  # an empty object has no byte 0
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
            obj = self.answered(uri, size, headers)
            self.verify(obj, headers)
            return data, obj

        return await self.retrying(uri, (0, length), once, nbytes=length, source_errors=True)

    async def list_keys(self, bucket: str, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (not in sub-"directories"), sorted; a page token seen
        before, or more than ``max_list_pages`` pages, is an error: a server that answers with
        one more page for ever must not keep the open running for ever."""
        keys: list[str] = []
        token: str | None = None
        seen: set[str] = set()
        uri = self.uri_type(bucket, prefix)
        pages = self.settings.max_list_pages
        for _ in range(pages):
            url = self.list_page_url(bucket, prefix, token)

            async def once(speed: LowSpeed, url: str = url) -> tuple[list[str], str | None]:
                _, _, body = await self.get(uri, url, {}, LIST_PAGE_BYTES, speed)
                if len(body) > LIST_PAGE_BYTES:
                    raise Fatal(f"a listing page of more than {LIST_PAGE_BYTES >> 20} MiB")
                return self.parse_page(body)

            names, token = await self.retrying(uri, None, once, nbytes=LIST_PAGE_BYTES, source_errors=True)
            keys.extend(names)
            if not token:
                return sorted(keys)
            if token in seen:
                raise self.source_error("the listing repeats a page token: it would never end", uri)
            seen.add(token)
        raise self.source_error(f"the listing has more than {pages} pages (max_list_pages)", uri)

    async def get_object(self, uri: ObjectUri, limit: int) -> bytes:
        """A whole small object, e.g. an index file; ``ObjectSourceError`` when it is over ``limit``."""
        data, obj = await self.get_start(uri, min(limit, 1 << 20))
        if obj.size > limit:
            raise self.source_error(f"the object is {obj.size} bytes, more than the limit of {limit}", uri)
        if obj.size > len(data):
            data += await self.get_bytes(obj, len(data), obj.size, source_errors=True)
        return data


def _with_query(url: str, query: str) -> str:
    if not query:
        return url
    return f"{url}{'&' if '?' in url else '?'}{query}"

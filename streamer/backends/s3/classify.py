"""What an S3 failure means: worth another try (``Retry``) or not (``Fatal``), and why.

Also the checks every response passes whatever made it (encoding, ETag comparison).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Any

from streamer.backends.http.client import Fatal, Retry
from streamer.backends.http.endpoint import ProxyError, UnsupportedProxy
from streamer.backends.http.response import HttpFailure, ProtocolViolation, SizeChanged

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
CHANGED = "the object changed during the load (its ETag or size is not the header's)"
GONE_CODES = frozenset(
    {"NoSuchKey", "NoSuchBucket", "AccessDenied", "NotFound", "Forbidden", "NoCredentials"}
)
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound"})


REDIRECTS = frozenset({301, 302, 303, 307, 308})
REDIRECT_CODES = frozenset({"PermanentRedirect", "TemporaryRedirect", "Redirect"})


def _classify_status(
    status: int | None, code: str | None, elsewhere: Mapping[str, str | None] | None = None
) -> Retry | Fatal:
    if status in REDIRECTS or code in REDIRECT_CODES:
        hints = {k: v for k, v in (elsewhere or {}).items() if v}
        where = ", ".join(f"{k} {v}" for k, v in hints.items()) or "another region or endpoint"
        reason = f"the bucket is elsewhere ({where}): set S3Config.region / endpoint_url to it"
        return Fatal(reason, status, code)
    if status in _RETRYABLE_STATUS or code in _RETRYABLE_CODES or (status or 0) >= 500:
        return Retry("the server asked to retry", status, code)
    if status == 412 or code == "PreconditionFailed":
        return Fatal(CHANGED, status, code)
    if status == 404 or code in MISSING_CODES:
        what = "bucket" if code == "NoSuchBucket" else "object"
        return Fatal(f"no such {what}", status, code)
    if status == 403 or code in ("AccessDenied", "Forbidden"):
        return Fatal("access denied", status, code)
    if status is not None and 200 <= status < 300:
        return Retry("an unusable response (no Content-Length, or not the range asked for)", status, code)
    return Fatal("request refused", status, code)


def _classify_proxy(status: int, reason: str) -> Retry | Fatal:
    """A proxy's answer to a tunnel request: its 5xx may pass, its 403 or 407 will not."""
    return Retry(reason, status) if status >= 500 else Fatal(reason, status)


def classify(exc: Exception) -> Retry | Fatal:

    import aiohttp
    import botocore.exceptions as be

    if isinstance(exc, (Retry, Fatal)):
        return exc
    if isinstance(exc, HttpFailure):
        elsewhere = {
            "region": exc.headers.get("x-amz-bucket-region") or exc.fields.get("Region"),
            "endpoint": exc.fields.get("Endpoint"),
        }
        return _classify_status(exc.status, exc.code, elsewhere)
    if isinstance(exc, ProtocolViolation):
        return Fatal(str(exc)) if exc.fatal else Retry(str(exc))
    if isinstance(exc, SizeChanged):
        return Fatal(f"{CHANGED}: {exc}")
    if isinstance(exc, ProxyError):
        return _classify_proxy(exc.status, str(exc))
    if isinstance(exc, UnsupportedProxy):
        return Fatal(str(exc))
    if isinstance(exc, be.ClientError):
        response: Mapping[str, Any] = exc.response
        error = response.get("Error", {})
        meta = response.get("ResponseMetadata", {})
        elsewhere = {
            "region": meta.get("HTTPHeaders", {}).get("x-amz-bucket-region") or error.get("Region"),
            "endpoint": error.get("Endpoint"),
        }
        return _classify_status(meta.get("HTTPStatusCode"), error.get("Code"), elsewhere)
    if isinstance(exc, (be.NoCredentialsError, be.PartialCredentialsError)):
        return Fatal(
            "no usable credentials (set them, or use anonymous access for public buckets)",
            None,
            "NoCredentials",
        )
    if isinstance(exc, be.ProxyConnectionError):  # the client's own requests: a tunnel refused, or no proxy
        status = getattr(exc.kwargs.get("error"), "status", None)
        if isinstance(status, int):
            return _classify_proxy(status, f"the proxy refused the tunnel: HTTP {status}")
        return Retry(f"proxy failure: {exc}")
    if isinstance(exc, (be.SSLError, ssl.SSLCertVerificationError)):
        return Fatal(f"TLS failure: {type(exc).__name__}")
    if isinstance(exc, (be.HTTPClientError, be.ConnectionError, be.IncompleteReadError)):
        return Retry(f"connection failure: {type(exc).__name__}")
    if isinstance(exc, be.BotoCoreError):
        return Fatal(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError, OSError)):
        return Retry(f"connection failure: {type(exc).__name__}")
    return Fatal(f"unexpected failure: {type(exc).__name__}: {exc}")


def check_encoding(response: Mapping[str, Any]) -> None:
    encoding = (response.get("ContentEncoding") or "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise Fatal(f"the server encoded the body (Content-Encoding: {encoding[:40]})")


def normal_etag(text: str | None) -> str | None:
    """An ETag compared as S3 means it: quotes and a weak ``W/`` prefix do not make it another."""
    if text is None:
        return None
    value = text.strip().removeprefix("W/").strip().strip('"')
    return value or None


def if_match(etag: str | None) -> str | None:
    """The ``If-Match`` for an ETag: quoted; none for a weak one, which If-Match never matches
    (RFC 9110 compares strongly), so that only the returned ETag is compared."""
    value = normal_etag(etag)
    if value is None or etag is None or etag.strip().startswith("W/"):
        return None
    return f'"{value}"'

"""What an S3 error answer means: worth another try (``Retry``) or not (``Fatal``), and why;
and how S3 ETags compare."""

from __future__ import annotations

from collections.abc import Mapping

from streamer.backends.http.client import Fatal, Retry

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RETRY_CODES = frozenset(
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
# Signed for another region than the bucket's: AWS answers 400 and names the bucket's region.
WRONG_REGION_CODES = frozenset({"AuthorizationHeaderMalformed", "AuthorizationQueryParametersError"})


def classify_status(
    status: int | None, code: str | None, elsewhere: Mapping[str, str | None] | None = None
) -> Retry | Fatal:
    hints = {k: v for k, v in (elsewhere or {}).items() if v}
    if status in REDIRECTS or code in REDIRECT_CODES or (code in WRONG_REGION_CODES and "region" in hints):
        where = ", ".join(f"{k} {v}" for k, v in hints.items()) or "another region or endpoint"
        reason = f"the bucket is elsewhere ({where}): set S3Config.region / endpoint_url to it"
        return Fatal(reason, status, code)
    if status in _RETRYABLE_STATUS or code in RETRY_CODES or (status or 0) >= 500:
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

"""AWS Signature Version 4 for S3 GETs, in the query string (a presigned URL): what authorises
every request the S3 client sends, header reads, listings and data alike.

Our own, not botocore's signer: importing botocore's client machinery costs ~0.3 s of every cold
start, and a GET's signature is a few lines of HMAC-SHA256. The payload is ``UNSIGNED-PAYLOAD``
(a GET has none) and the only signed header is ``Host``, so the ``Range`` and ``If-Match`` a
request adds need no new signature. ``tests/test_s3_signing.py`` checks it against botocore's.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, urlsplit

ALGORITHM = "AWS4-HMAC-SHA256"
_UNRESERVED = "-_.~"


@dataclass(frozen=True)
class Credentials:
    """An access key, its secret, and a session token where the key is temporary."""

    access_key: str
    secret_key: str = field(repr=False)
    token: str | None = field(default=None, repr=False)


def presign(url: str, credentials: Credentials, region: str, now: datetime.datetime, expires: int) -> str:
    """The query parameters (``a=b&...``) that, added to ``url``'s own, authorise a GET of it
    from ``now`` (UTC) for ``expires`` seconds. ``url``'s path and query must be sent as given."""
    parts = urlsplit(url)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    scope = f"{day}/{region}/s3/aws4_request"
    auth = [
        ("X-Amz-Algorithm", ALGORITHM),
        ("X-Amz-Credential", f"{credentials.access_key}/{scope}"),
        ("X-Amz-Date", stamp),
        ("X-Amz-Expires", str(expires)),
        ("X-Amz-SignedHeaders", "host"),
    ]
    if credentials.token:
        auth.append(("X-Amz-Security-Token", credentials.token))
    params = parse_qsl(parts.query, keep_blank_values=True) + auth
    canonical_query = "&".join(f"{_encode(k)}={_encode(v)}" for k, v in sorted((k, v) for k, v in params))
    canonical_request = "\n".join(
        ["GET", parts.path or "/", canonical_query, f"host:{parts.netloc}", "", "host", "UNSIGNED-PAYLOAD"]
    )
    to_sign = "\n".join([ALGORITHM, stamp, scope, _sha256(canonical_request)])
    key = _signing_key(credentials.secret_key, day, region)
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return "&".join(f"{_encode(k)}={_encode(v)}" for k, v in auth) + f"&X-Amz-Signature={signature}"


def _encode(text: str) -> str:
    return quote(text, safe=_UNRESERVED)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _signing_key(secret: str, day: str, region: str) -> bytes:
    """The day's key for S3 in ``region``: four HMACs, the same for every request of that day."""
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key

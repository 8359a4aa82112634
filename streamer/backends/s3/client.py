"""S3 reads: the shared REST object-store client (``backends/http/rest.py``: the loop thread, its
own connections, retries, the data path's ``fetch_into``) with S3's part of the contract:
virtual-hosted or path-style URLs (``object_url``), SigV4 presigned requests (``sigv4.py``, with
the credentials of ``identity.py``), the ETag rule (``identity_headers``, ``verify``), S3's error
codes (``classify.py``), ListObjectsV2 pages, and errors naming bucket and key.

Each request is retried on throttling, 5xx, connection errors, timeouts and short bodies, for the
bytes no verified response delivered only, with exponential backoff and full jitter, until
``max_attempts`` tries or ``retry_deadline`` seconds; each try is cut after ``attempt_allowance +
bytes / min_rate`` seconds, and the feeder's tries at the run's ``load_deadline``. Every response
(header reads too) must be the range asked for, of the size and ETag the header read saw (an
ETag is required unless ``require_etag`` is off); ranged GETs after the header read also carry
``If-Match``: an object replaced during a load is an error, never a mixed checkpoint.

No SDK client is made: botocore is imported only where its credential chain is needed
(``identity.py``), so an S3 open costs its requests, not ~0.5 s of imports and client set-up.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from urllib.parse import quote, unquote_plus, urlencode, urlsplit

from streamer.backends.http.client import Fatal, Retry
from streamer.backends.http.endpoint import Target
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.response import HttpFailure, xml_error_code
from streamer.backends.http.rest import RestObjectClient
from streamer.backends.s3.classify import (
    CHANGED,
    GONE_CODES,
    MISSING_CODES,
    REDIRECT_CODES,
    REDIRECTS,
    RETRY_CODES,
    WRONG_REGION_CODES,
    classify_status,
    if_match,
    normal_etag,
)
from streamer.backends.s3.identity import Identity
from streamer.backends.s3.sigv4 import presign
from streamer.backends.s3.uri import ObjectInfo, S3Uri
from streamer.config import S3Config
from streamer.errors import ConfigError, ObjectSourceError, S3Error, S3MissingError, S3SourceError

PRESIGN_SECONDS = 3600
_DNS_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class S3Client(RestObjectClient):
    """An S3 endpoint as ``config`` describes it. Use as a context manager or ``close()``."""

    uri_type = S3Uri
    changed = CHANGED
    retry_codes = RETRY_CODES
    missing_codes = MISSING_CODES

    def __init__(self, config: S3Config) -> None:
        super().__init__(config, "s3", config.concurrency, config.header_bytes)
        self.config = config
        self._virtual_hosts: dict[str, str | None] = {}  # per bucket: decided once, read per GET
        try:
            self._identity = Identity(config)
            self._service = _service_url(config, self._identity.region)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> S3Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancels running requests, closes every connection, stops the thread. Idempotent."""
        super().close()
        identity = getattr(self, "_identity", None)
        if identity is not None:
            identity.forget()

    # --- where requests go and how they are signed -------------------------------------------

    def _virtual(self, bucket: str) -> str | None:
        """The bucket's virtual host URL (``scheme://bucket.host``), or None for path-style
        (``host/bucket``), by botocore's rule: ``auto`` is virtual on AWS for DNS-safe names,
        path-style on other endpoints."""
        if bucket not in self._virtual_hosts:
            self._virtual_hosts[bucket] = self._virtual_host(bucket)
        return self._virtual_hosts[bucket]

    def _virtual_host(self, bucket: str) -> str | None:
        parts = urlsplit(self._service)
        style = self.config.addressing_style
        virtual = style == "virtual" or (style == "auto" and self.config.endpoint_url is None)
        if virtual and _virtual_hostable(bucket, parts.hostname or "", parts.scheme):
            return f"{parts.scheme}://{bucket}.{parts.netloc}{parts.path}"
        return None

    def object_url(self, uri: ObjectUri, version: str | None) -> str:
        key = quote(uri.key, safe="/~")
        virtual = self._virtual(uri.bucket)
        return f"{virtual}/{key}" if virtual else f"{self._service}/{quote(uri.bucket, safe='')}/{key}"

    async def authorization(self, uri: ObjectUri, url: str) -> tuple[dict[str, str], str]:
        credentials = await self._identity.credentials()
        if credentials is None:
            return {}, ""
        now = datetime.datetime.now(datetime.timezone.utc)
        return {}, presign(url, credentials, self._identity.region, now, PRESIGN_SECONDS)

    # --- what an answer means ------------------------------------------------------------------

    def version_from(self, headers: Mapping[str, str]) -> str | None:
        return headers.get("etag")

    def identity_headers(self, obj: StoredObject) -> dict[str, str]:
        condition = if_match(obj.version)
        return {"If-Match": condition} if condition else {}

    def verify(self, obj: StoredObject, headers: Mapping[str, str]) -> bool:
        """Refuses a response of another object version; True when the version is proved.

        Without an ETag on both sides nothing proves it: an error, unless ``require_etag`` is off.
        """
        got, expected = normal_etag(headers.get("etag")), normal_etag(obj.version)
        if got is not None and expected is not None:
            if got != expected:
                raise Fatal(CHANGED)
            return True
        if self.config.require_etag:
            raise Fatal(
                "the server sent no ETag, so the object's version cannot be verified "
                "(S3Config.require_etag=False accepts that risk)"
            )
        return False

    def classify(self, exc: Exception) -> Retry | Fatal:
        if isinstance(exc, HttpFailure):
            elsewhere = {
                "region": exc.headers.get("x-amz-bucket-region") or exc.fields.get("Region"),
                "endpoint": exc.fields.get("Endpoint"),
            }
            return classify_status(exc.status, exc.code, elsewhere)
        return super().classify(exc)

    def error_type(self, failure: Retry | Fatal, *, source_errors: bool) -> type[S3Error]:
        """A missing or forbidden object raises ``S3SourceError`` where it does not resolve the source,
        ``S3Error`` where it went away during the load."""
        gone = source_errors and (
            failure.status in (403, 404, 407, *REDIRECTS)
            or failure.code in GONE_CODES | REDIRECT_CODES | WRONG_REGION_CODES
        )
        missing = failure.status == 404 or failure.code in MISSING_CODES
        return (S3MissingError if missing else S3SourceError) if gone else S3Error

    def error_code(self, headers: Mapping[str, str], body: bytes) -> str | None:
        return xml_error_code(body)

    def token_refused(self) -> None:
        """S3 answers bad or expired credentials with 400/403 codes, never 401: nothing to do."""

    def missing(self, code: str | None) -> str:
        return "bucket" if code == "NoSuchBucket" else "object"

    def bucket_missing(self, error: ObjectSourceError) -> bool:
        return bool(error.code == "NoSuchBucket")

    def source_error(self, message: str, uri: ObjectUri) -> S3SourceError:
        return S3SourceError(message, bucket=uri.bucket, key=uri.key)

    # --- objects and listings --------------------------------------------------------------------

    def stored(self, uri: ObjectUri, size: int, version: str | None) -> ObjectInfo:
        return ObjectInfo(uri, size, version)

    def list_page_url(self, bucket: str, prefix: str, token: str | None) -> str:
        query = [("list-type", "2"), ("prefix", prefix), ("delimiter", "/"), ("encoding-type", "url")]
        if token:
            query.append(("continuation-token", token))
        virtual = self._virtual(bucket)
        root = f"{virtual}/" if virtual else f"{self._service}/{quote(bucket, safe='')}"
        return f"{root}?{urlencode(query, quote_via=quote, safe='-_.~')}"

    def parse_page(self, body: bytes) -> tuple[list[str], str | None]:
        """A ListObjectsV2 page's keys (URL-decoded where the page says it encoded them) and its
        continuation token (None unless the listing is truncated)."""
        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            raise Retry("the listing is not XML") from None
        keys: list[str] = []
        encoded = truncated = False
        token: str | None = None
        for child in root:
            name = _local(child.tag)
            if name == "Contents":
                keys += [item.text for item in child if _local(item.tag) == "Key" and item.text]
            elif name == "EncodingType":
                encoded = (child.text or "").strip() == "url"
            elif name == "IsTruncated":
                truncated = (child.text or "").strip().lower() == "true"
            elif name == "NextContinuationToken":
                token = child.text
        if encoded:
            keys = [unquote_plus(key) for key in keys]
        return keys, token if truncated and token else None


def _local(tag: str) -> str:
    """An XML tag without its namespace."""
    return tag.rpartition("}")[2]


def _virtual_hostable(bucket: str, host: str, scheme: str) -> bool:
    """Whether ``bucket`` can be a host name label under ``host`` (TLS certificates cover one
    label: no dots over https; an IP address has no sub-domains)."""
    if not _DNS_BUCKET.fullmatch(bucket) or ".." in bucket or (scheme == "https" and "." in bucket):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def _service_url(config: S3Config, region: str) -> str:
    """The endpoint requests go to, without a trailing slash: the configured one, else AWS's for
    the region."""
    if config.endpoint_url is not None:
        url = config.endpoint_url.rstrip("/")
        try:
            Target.parse(url)
        except ValueError as exc:
            refused = f"cannot make an S3 client for endpoint {config.endpoint_url!r}: ValueError: {exc}"
        else:
            return url
        raise ConfigError(refused)  # outside the except block: no parsing error on the chain
    if region == "us-east-1":
        return "https://s3.amazonaws.com"
    suffix = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"https://s3.{region}.{suffix}"

"""S3 reads: the shared HTTP object-store client (``backends/http/client.py``: the loop thread,
retries, the data path's ``fetch_into``) with one aiobotocore client, and S3's part of the
contract: SigV4 presigned URLs (``sign``), the ETag rule (``identity_headers``, ``verify``), S3's
error codes (``classify.py``) and errors naming bucket and key (``error``).

The aiobotocore client serves the header reads, listings and small objects of ``storage.py``;
``close()`` cancels what is still running, closes the client (and with it every connection),
stops the loop and joins the thread.

Each request is retried on throttling, 5xx, connection errors, timeouts and short bodies, for the
bytes no verified response delivered only, with exponential backoff and full jitter, until
``max_attempts`` tries or ``retry_deadline`` seconds; each try is cut after ``attempt_allowance +
bytes / min_rate`` seconds, and the feeder's tries at the run's ``load_deadline``. botocore's own
retries are off, so the attempt counts are ours. Every response (header reads too) must be the
range asked for, of the size and ETag the header read saw (an ETag is required unless
``require_etag`` is off); ranged GETs after the header read also carry ``If-Match``: an object
replaced during a load is an error, never a mixed checkpoint. Errors are raised outside ``except``
blocks, so no exception of the failed request (with its signed headers) hangs on their chain.

aiobotocore and botocore are imported only when a client is made: ``import streamer`` stays cheap.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any, TypeVar

from streamer.backends.http.client import Fatal, ObjectStoreClient, Retry
from streamer.backends.http.endpoint import Target
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.response import content_range
from streamer.backends.http.timing import LowSpeed
from streamer.backends.optional import require_s3
from streamer.backends.s3.classify import (
    CHANGED,
    GONE_CODES,
    MISSING_CODES,
    REDIRECT_CODES,
    REDIRECTS,
    check_encoding,
    classify,
    if_match,
    normal_etag,
)
from streamer.backends.s3.redact import REDACTOR
from streamer.backends.s3.uri import ObjectInfo, S3Uri
from streamer.config import S3Config
from streamer.errors import ConfigError, ObjectSourceError, S3Error, S3MissingError, S3SourceError

T = TypeVar("T")

_PRESIGN_SECONDS = 3600
_LIST_PAGE_BYTES = 1 << 20  # a ListObjectsV2 page's size bound, for its attempt deadline


@functools.cache
def _data_loader() -> Any:
    """botocore's loader of service models and endpoints, shared by every session (it only caches
    files it parsed). Sessions and credentials stay per client."""
    from aiobotocore.session import get_session

    return get_session().get_component("data_loader")


def _refused_config(exc: Exception, config: S3Config) -> ConfigError | None:
    """The typed error for a client botocore will not make from ``config`` (an unknown profile,
    a malformed endpoint URL, ...); None for anything else."""
    import botocore.exceptions as be

    if not isinstance(exc, (be.BotoCoreError, ValueError)):
        return None
    where = f"endpoint {config.endpoint_url!r}" if config.endpoint_url else "the AWS default endpoint"
    return ConfigError(f"cannot make an S3 client for {where}: {type(exc).__name__}: {exc}")


class S3Client(ObjectStoreClient):
    """An aiobotocore S3 client on a private event loop thread. Use as a context manager or ``close()``."""

    def __init__(self, config: S3Config, *, pool: int | None = None) -> None:
        require_s3()
        super().__init__(config, "s3", config.concurrency)
        self.config = config
        self.header_bytes = config.header_bytes
        self._context: Any = None
        self._client: Any = None
        self._targets: dict[ObjectUri, tuple[Target, float]] = {}
        self._secrets = [
            secret
            for secret in (config.access_key_id, config.secret_access_key, config.session_token)
            if secret and not config.anonymous
        ]
        REDACTOR.add(self._secrets)
        refused: ConfigError | None = None
        try:
            self.call(self._open(pool if pool is not None else config.concurrency))
        except Exception as exc:
            self.close()
            refused = _refused_config(exc, config)
            if refused is None:
                raise
        except BaseException:
            self.close()
            raise
        if refused is not None:
            raise refused  # outside the except block: nothing of botocore's on the chain

    def __enter__(self) -> S3Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def _open(self, pool: int) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session
        from botocore import UNSIGNED

        c = self.config
        session = get_session()
        session.register_component("data_loader", _data_loader())  # parsed service models: ~0.1 s
        if c.profile is not None:
            session.set_config_variable("profile", c.profile)
        options: dict[str, Any] = {
            "s3": {"addressing_style": c.addressing_style},
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # ours are the only retries
            "connect_timeout": c.connect_timeout,
            "read_timeout": c.read_timeout,
            "max_pool_connections": max(pool, 1),
            "tcp_keepalive": True,
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        }
        # SigV4 (S3's default for requests) also for the presigned URLs of the data path
        options["signature_version"] = UNSIGNED if c.anonymous else "s3v4"
        credentials: dict[str, Any] = {}
        if c.access_key_id is not None and not c.anonymous:
            credentials = {
                "aws_access_key_id": c.access_key_id,
                "aws_secret_access_key": c.secret_access_key,
                "aws_session_token": c.session_token,
            }
        verify: bool | str = c.ca_bundle if c.ca_bundle and c.verify else c.verify
        context = session.create_client(
            "s3",
            endpoint_url=c.endpoint_url,
            region_name=c.region,
            verify=verify,
            config=AioConfig(**options),
            **credentials,
        )
        self._client = await context.__aenter__()
        self._context = context  # only an entered context has a client for close() to exit
        if not credentials and not c.anonymous:
            await self._redact_resolved_credentials(session)

    async def _redact_resolved_credentials(self, session: Any) -> None:
        """Masks what boto3's chain found (environment, profile, role) like explicit credentials.

        The session caches what it resolved, so these are the credentials the client signs with.
        """
        resolved = await session.get_credentials()
        if resolved is None:
            return
        frozen = await resolved.get_frozen_credentials()
        found = [s for s in (frozen.access_key, frozen.secret_key, frozen.token) if s]
        REDACTOR.add(found)
        self._secrets = [*self._secrets, *found]

    def close(self) -> None:
        """Cancels running requests, closes the client (and with it every connection), stops the
        thread. Idempotent."""
        super().close()
        REDACTOR.remove(self._secrets)

    async def release(self) -> None:
        context, self._context, self._client = self._context, None, None
        if context is not None:
            await context.__aexit__(None, None, None)

    # --- requests (coroutines: run them on the loop) ---------------------------------------

    def classify(self, exc: Exception) -> Retry | Fatal:
        return classify(exc)

    def error_type(self, failure: Retry | Fatal, *, source_errors: bool) -> type[S3Error]:
        """A missing or forbidden object raises ``S3SourceError`` where it does not resolve the source,
        ``S3Error`` where it went away during the load."""
        gone = source_errors and (
            failure.status in (403, 404, 407, *REDIRECTS) or failure.code in GONE_CODES | REDIRECT_CODES
        )
        missing = failure.status == 404 or failure.code in MISSING_CODES
        return (S3MissingError if missing else S3SourceError) if gone else S3Error

    uri_type = S3Uri

    def bucket_missing(self, error: ObjectSourceError) -> bool:
        return bool(error.code == "NoSuchBucket")

    def source_error(self, message: str, uri: ObjectUri) -> S3SourceError:
        return S3SourceError(message, bucket=uri.bucket, key=uri.key)

    def identity_headers(self, obj: StoredObject) -> dict[str, str]:
        condition = if_match(obj.version)
        return {"If-Match": condition} if condition else {}

    def verify(self, obj: StoredObject, headers: Mapping[str, str]) -> bool:
        return self._check_etag(obj, headers.get("etag"))

    def _check_etag(self, info: StoredObject, etag: str | None) -> bool:
        """Refuses a response of another object version; True when the version is proved.

        Without an ETag on both sides nothing proves it: an error, unless ``require_etag`` is off.
        """
        got, expected = normal_etag(etag), normal_etag(info.version)
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

    async def get_start(self, uri: ObjectUri, length: int) -> tuple[bytes, ObjectInfo]:
        """Up to ``length`` bytes from the start of the object, with its size and ETag (one GET)."""

        async def once(speed: LowSpeed) -> tuple[bytes, ObjectInfo]:
            import botocore.exceptions as be

            self.requests += 1
            try:
                response = await self._client.get_object(
                    Bucket=uri.bucket, Key=uri.key, Range=f"bytes=0-{length - 1}"
                )
            except be.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "InvalidRange":  # an empty object
                    return b"", ObjectInfo(uri, 0, None)
                raise
            body = response["Body"]
            try:
                check_encoding(response)
                status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                span = content_range(response.get("ContentRange"))
                if span is not None:
                    size = span[2]
                    if span[:2] != (0, min(length, size) - 1):
                        raise Retry(
                            f"the server sent bytes {span[0]}-{span[1]}, not 0-{min(length, size) - 1}"
                        )
                elif status == 200:
                    size = int(response["ContentLength"])
                else:
                    raise Retry(f"an HTTP {status} without a valid Content-Range")
                want = min(length, size)
                length_given = response.get("ContentLength")  # none for a chunked body
                if span is not None and length_given is not None and length_given != want:
                    raise Retry(f"a Content-Length of {length_given}, not {want}")
                info = ObjectInfo(uri, size, response.get("ETag"))
                if info.etag is None and self.config.require_etag:
                    self._check_etag(info, None)
                data = bytearray()
                while len(data) < want:
                    chunk = await body.read(want - len(data))
                    if not chunk:
                        raise Retry(f"short body: {len(data)} of {want} bytes")
                    data += chunk
                    speed.moved += len(chunk)
            finally:
                body.close()
            self.bytes_fetched += len(data)
            return bytes(data), info

        return await self.retrying(uri, (0, length), once, nbytes=length, source_errors=True)

    async def sign(self, obj: StoredObject) -> tuple[Target, dict[str, str]]:
        """The object's presigned GET URL, re-signed when half of its validity has passed."""
        uri = obj.uri
        now = time.monotonic()
        cached = self._targets.get(uri)
        if cached is None or now - cached[1] > _PRESIGN_SECONDS / 2:
            url = await self._client.generate_presigned_url(
                "get_object", Params={"Bucket": uri.bucket, "Key": uri.key}, ExpiresIn=_PRESIGN_SECONDS
            )
            cached = (Target.parse(url), now)
            self._targets[uri] = cached
        return cached[0], {}

    async def get_object(self, uri: ObjectUri, limit: int) -> bytes:
        """A whole small object, e.g. an index file; ``S3SourceError`` when it is over ``limit`` bytes."""
        data, info = await self.get_start(uri, min(limit, 1 << 20))
        if info.size > limit:
            raise S3SourceError(
                f"the object is {info.size} bytes, more than the limit of {limit}",
                bucket=uri.bucket,
                key=uri.key,
            )
        if len(data) < info.size:
            data += await self.get_bytes(info, len(data), info.size, source_errors=True)
        return data

    async def list_keys(self, bucket: str, prefix: str) -> list[str]:
        """Keys directly under ``prefix`` (not in sub-"directories"), sorted.

        A continuation token seen before, or more than ``max_list_pages`` pages, is an error: a
        server that answers ``IsTruncated`` for ever must not keep the open running for ever.
        """
        keys: list[str] = []
        token: str | None = None
        seen: set[str] = set()
        uri = S3Uri(bucket, prefix)
        for _ in range(self.config.max_list_pages):
            options: dict[str, Any] = {"ContinuationToken": token} if token else {}

            async def once(speed: LowSpeed, options: dict[str, Any] = options) -> dict[str, Any]:
                # A page arrives whole (aiobotocore): no byte counts before it, so a listing
                # slower than low_speed_window per page is cut as a trickle is.
                self.requests += 1
                result: dict[str, Any] = await self._client.list_objects_v2(
                    Bucket=bucket, Prefix=prefix, Delimiter="/", **options
                )
                return result

            page = await self.retrying(uri, None, once, nbytes=_LIST_PAGE_BYTES, source_errors=True)
            keys.extend(item["Key"] for item in page.get("Contents", []))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(keys)
            if token in seen:
                raise S3SourceError(
                    "the listing repeats a continuation token: it would never end", bucket=bucket, key=prefix
                )
            seen.add(token)
        raise S3SourceError(
            f"the listing has more than {self.config.max_list_pages} pages (S3Config.max_list_pages)",
            bucket=bucket,
            key=prefix,
        )

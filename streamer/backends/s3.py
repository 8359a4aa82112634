"""S3 reads: one asyncio event loop on one background thread, one aiobotocore client.

``S3Client`` owns the loop, its thread and the client; ``close()`` cancels what is still running,
closes the client (and with it every connection), stops the loop and joins the thread.
``S3Feeder`` serves the blocks of S3 files for one run: a fixed number of worker tasks (the
``concurrency``) pull blocks from a queue, fetch each with a ranged GET whose body is copied chunk
by chunk straight into the block's destination memory, and credit the block to the native engine
exactly as a reader thread would; a failure is reported to the engine, so the run's waiter wakes
as for a failed local read.

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

import asyncio
import functools
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from streamer.backends.http import (
    Connection,
    HttpFailure,
    ProtocolViolation,
    ProxyError,
    SizeChanged,
    Target,
    UnsupportedProxy,
    bounded,
    content_range,
    ssl_context,
)
from streamer.backends.optional import require_s3
from streamer.config import S3Config
from streamer.engine import native
from streamer.errors import ConfigError, S3Error, S3SourceError, SourceError

T = TypeVar("T")

SCHEME = "s3://"
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
_PRESIGN_SECONDS = 3600
_CHANGED = "the object changed during the load (its ETag or size is not the header's)"
_LIST_PAGE_BYTES = 1 << 20  # a ListObjectsV2 page's size bound, for its attempt deadline
_GONE_CODES = frozenset(
    {"NoSuchKey", "NoSuchBucket", "AccessDenied", "NotFound", "Forbidden", "NoCredentials"}
)


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def parse_uri(text: str) -> S3Uri:
    """``s3://bucket/key`` (the key may be empty or end with ``/`` for a prefix)."""
    if not text.startswith(SCHEME):
        raise SourceError("not an S3 URI (expected s3://bucket/key)", path=text)
    bucket, _, key = text[len(SCHEME) :].partition("/")
    if not bucket or any(c in bucket for c in " \\?#") or bucket in (".", ".."):
        raise SourceError("bad S3 URI: no valid bucket name (expected s3://bucket/key)", path=text)
    if "\0" in key:
        raise SourceError("bad S3 URI: the key contains a NUL byte", path=text)
    return S3Uri(bucket, key)


@dataclass(frozen=True)
class ObjectInfo:
    """An object as its header read saw it; later reads must see the same size and ETag."""

    uri: S3Uri
    size: int
    etag: str | None


class _Retry(Exception):
    """One try failed in a way worth another."""

    def __init__(self, reason: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status, self.code = reason, status, code


class _Fatal(Exception):
    """One try failed in a way no retry can fix."""

    def __init__(self, reason: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status, self.code = reason, status, code


_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_REDIRECT_CODES = frozenset({"PermanentRedirect", "TemporaryRedirect", "Redirect"})


def _classify_status(
    status: int | None, code: str | None, elsewhere: Mapping[str, str | None] | None = None
) -> _Retry | _Fatal:
    if status in _REDIRECTS or code in _REDIRECT_CODES:
        hints = {k: v for k, v in (elsewhere or {}).items() if v}
        where = ", ".join(f"{k} {v}" for k, v in hints.items()) or "another region or endpoint"
        reason = f"the bucket is elsewhere ({where}): set S3Config.region / endpoint_url to it"
        return _Fatal(reason, status, code)
    if status in _RETRYABLE_STATUS or code in _RETRYABLE_CODES or (status or 0) >= 500:
        return _Retry("the server asked to retry", status, code)
    if status == 412 or code == "PreconditionFailed":
        return _Fatal(_CHANGED, status, code)
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
        what = "bucket" if code == "NoSuchBucket" else "object"
        return _Fatal(f"no such {what}", status, code)
    if status == 403 or code in ("AccessDenied", "Forbidden"):
        return _Fatal("access denied", status, code)
    if status is not None and 200 <= status < 300:
        return _Retry("an unusable response (no Content-Length, or not the range asked for)", status, code)
    return _Fatal("request refused", status, code)


def _classify_proxy(status: int, reason: str) -> _Retry | _Fatal:
    """A proxy's answer to a tunnel request: its 5xx may pass, its 403 or 407 will not."""
    return _Retry(reason, status) if status >= 500 else _Fatal(reason, status)


def _classify(exc: Exception) -> _Retry | _Fatal:
    import ssl

    import aiohttp
    import botocore.exceptions as be

    if isinstance(exc, (_Retry, _Fatal)):
        return exc
    if isinstance(exc, HttpFailure):
        elsewhere = {
            "region": exc.headers.get("x-amz-bucket-region") or exc.fields.get("Region"),
            "endpoint": exc.fields.get("Endpoint"),
        }
        return _classify_status(exc.status, exc.code, elsewhere)
    if isinstance(exc, ProtocolViolation):
        return _Fatal(str(exc)) if exc.fatal else _Retry(str(exc))
    if isinstance(exc, SizeChanged):
        return _Fatal(f"{_CHANGED}: {exc}")
    if isinstance(exc, ProxyError):
        return _classify_proxy(exc.status, str(exc))
    if isinstance(exc, UnsupportedProxy):
        return _Fatal(str(exc))
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
        return _Fatal(
            "no usable credentials (set them, or use anonymous access for public buckets)",
            None,
            "NoCredentials",
        )
    if isinstance(exc, be.ProxyConnectionError):  # the client's own requests: a tunnel refused, or no proxy
        status = getattr(exc.kwargs.get("error"), "status", None)
        if isinstance(status, int):
            return _classify_proxy(status, f"the proxy refused the tunnel: HTTP {status}")
        return _Retry(f"proxy failure: {exc}")
    if isinstance(exc, (be.SSLError, ssl.SSLCertVerificationError)):
        return _Fatal(f"TLS failure: {type(exc).__name__}")
    if isinstance(exc, (be.HTTPClientError, be.ConnectionError, be.IncompleteReadError)):
        return _Retry(f"connection failure: {type(exc).__name__}")
    if isinstance(exc, be.BotoCoreError):
        return _Fatal(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ConnectionError, OSError)):
        return _Retry(f"connection failure: {type(exc).__name__}")
    return _Fatal(f"unexpected failure: {type(exc).__name__}: {exc}")


def _check_encoding(response: Mapping[str, Any]) -> None:
    encoding = (response.get("ContentEncoding") or "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _Fatal(f"the server encoded the body (Content-Encoding: {encoding[:40]})")


def _etag(text: str | None) -> str | None:
    """An ETag compared as S3 means it: quotes and a weak ``W/`` prefix do not make it another."""
    if text is None:
        return None
    value = text.strip().removeprefix("W/").strip().strip('"')
    return value or None


def _if_match(etag: str | None) -> str | None:
    """The ``If-Match`` for an ETag: quoted; none for a weak one, which If-Match never matches
    (RFC 9110 compares strongly), so that only the returned ETag is compared."""
    value = _etag(etag)
    if value is None or etag is None or etag.strip().startswith("W/"):
        return None
    return f'"{value}"'


class _Redactor(logging.Filter):
    """Masks the credentials of open clients in botocore's DEBUG records.

    botocore logs the canonical request (with ``X-Amz-Security-Token``) and the prepared
    request's headers (the access key id in ``Authorization``) at DEBUG level. The filter only
    rewrites records that contain a credential of a client open right now; anything else passes
    unchanged, so installing it changes nothing else about those loggers.
    """

    _LOGGERS = ("botocore.auth", "botocore.endpoint", "aiobotocore.endpoint")

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._secrets: dict[str, int] = {}
        self._installed = False

    def add(self, secrets: Sequence[str]) -> None:
        with self._lock:
            if not self._installed:
                self._installed = True
                for name in self._LOGGERS:
                    logging.getLogger(name).addFilter(self)
            for secret in secrets:
                self._secrets[secret] = self._secrets.get(secret, 0) + 1

    def remove(self, secrets: Sequence[str]) -> None:
        with self._lock:
            for secret in secrets:
                left = self._secrets.get(secret, 0) - 1
                if left > 0:
                    self._secrets[secret] = left
                else:
                    self._secrets.pop(secret, None)

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = list(self._secrets)
        if not secrets:
            return True
        try:
            message = record.getMessage()
        except Exception:
            return True
        if any(secret in message for secret in secrets):
            for secret in secrets:
                message = message.replace(secret, "***")
            record.msg, record.args = message, None
        return True


_REDACTOR = _Redactor()


async def _cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancels the tasks and waits until every one has ended.

    Cancelling again until they are gone: on Python < 3.12, ``asyncio.wait_for`` can swallow a
    cancellation that arrives as its inner future completes, and the task would then go on to
    wait on the block queue for ever.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at shutdown


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


class S3Client:
    """An aiobotocore S3 client on a private event loop thread. Use as a context manager or ``close()``."""

    def __init__(self, config: S3Config, *, pool: int | None = None) -> None:
        require_s3()
        self.config = config
        self.requests = 0
        self.retries = 0
        self.bytes_fetched = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="streamer-s3", daemon=True)
        self._thread.start()
        self._context: Any = None
        self._client: Any = None
        self._targets: dict[S3Uri, tuple[Target, float]] = {}
        self._ssl = (
            ssl_context(config.ca_bundle, config.verify) if config.verify else ssl_context(None, False)
        )
        self._secrets = [
            secret
            for secret in (config.access_key_id, config.secret_access_key, config.session_token)
            if secret and not config.anonymous
        ]
        _REDACTOR.add(self._secrets)
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

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs ``coroutine`` on the loop and waits for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

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
        _REDACTOR.add(found)
        self._secrets = [*self._secrets, *found]

    def close(self) -> None:
        """Cancels running requests, closes the client and its connections, stops the thread. Idempotent."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self.call(self._shutdown())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join()
        self.loop.close()
        _REDACTOR.remove(self._secrets)

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        await _cancel_all([t for t in asyncio.all_tasks() if t is not current])
        context, self._context, self._client = self._context, None, None
        if context is not None:
            await context.__aexit__(None, None, None)
        await asyncio.sleep(0)  # let closed transports run their connection_lost callbacks

    # --- requests (coroutines: run them on the loop) ---------------------------------------

    def attempt_seconds(self, nbytes: int) -> float:
        """How long one try for ``nbytes`` may take: the allowance, plus the bytes at the minimum rate."""
        return self.config.attempt_allowance + nbytes / self.config.min_rate

    async def retrying(
        self,
        uri: S3Uri,
        byte_range: tuple[int, int] | None,
        once: Callable[[], Coroutine[Any, Any, T]],
        *,
        nbytes: int,
        source_errors: bool = False,
        until: float | None = None,
    ) -> T:
        """Runs ``once`` until it succeeds, fails for good, or runs out of tries or time.

        Each try is cut after ``attempt_seconds(nbytes)`` (a trickling server is a stall too);
        ``until`` (a ``time.monotonic()`` instant) cuts a try in flight and starts none after it.
        ``source_errors``: a missing or forbidden object raises ``S3SourceError`` (the source does
        not resolve) rather than ``S3Error`` (it went away during the load). The error is raised
        outside any ``except`` block: its ``__context__`` holds nothing of the failed request.
        """
        c = self.config
        started = time.monotonic()
        attempts = 0
        while True:
            attempts += 1
            budget = self.attempt_seconds(nbytes)
            cut_by_deadline = until is not None and until - time.monotonic() < budget
            if until is not None:
                budget = min(budget, until - time.monotonic())
            failure: _Retry | _Fatal
            tried = time.monotonic()
            try:
                if budget <= 0:
                    raise TimeoutError
                return await bounded(once(), budget)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failure = _classify(exc)
                if isinstance(exc, TimeoutError) and time.monotonic() - tried >= budget:
                    if cut_by_deadline:
                        failure = _Fatal(f"the load deadline of {c.load_deadline:g} s passed")
                    else:
                        failure = _Retry(f"the try ran past its {budget:.3g} s (S3Config.min_rate)")
            where: dict[str, Any] = {
                "bucket": uri.bucket,
                "key": uri.key,
                "byte_range": byte_range,
                "status": failure.status,
                "code": failure.code,
                "attempts": attempts,
            }
            if isinstance(failure, _Fatal):
                gone = source_errors and (
                    failure.status in (403, 404, 407, *_REDIRECTS)
                    or failure.code in _GONE_CODES | _REDIRECT_CODES
                )
                raise (S3SourceError if gone else S3Error)(failure.reason, **where)
            delay = random.uniform(0.0, min(c.backoff_max, c.backoff_base * 2 ** (attempts - 1)))
            out_of_time = time.monotonic() - started + delay > c.retry_deadline
            past_until = until is not None and time.monotonic() + delay >= until
            if attempts >= c.max_attempts or out_of_time or past_until:
                if past_until:
                    why = f"gave up at the load deadline of {c.load_deadline:g} s"
                else:
                    why = f"gave up after {c.retry_deadline:g} s" if out_of_time else "gave up"
                raise S3Error(f"{why}: {failure.reason}", **where)
            self.retries += 1
            await asyncio.sleep(delay)

    def _check_etag(self, info: ObjectInfo, etag: str | None) -> bool:
        """Refuses a response of another object version; True when the version is proved.

        Without an ETag on both sides nothing proves it: an error, unless ``require_etag`` is off.
        """
        got, expected = _etag(etag), _etag(info.etag)
        if got is not None and expected is not None:
            if got != expected:
                raise _Fatal(_CHANGED)
            return True
        if self.config.require_etag:
            raise _Fatal(
                "the server sent no ETag, so the object's version cannot be verified "
                "(S3Config.require_etag=False accepts that risk)"
            )
        return False

    async def get_start(self, uri: S3Uri, length: int) -> tuple[bytes, ObjectInfo]:
        """Up to ``length`` bytes from the start of the object, with its size and ETag (one GET)."""

        async def once() -> tuple[bytes, ObjectInfo]:
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
                _check_encoding(response)
                status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                span = content_range(response.get("ContentRange"))
                if span is not None:
                    size = span[2]
                    if span[:2] != (0, min(length, size) - 1):
                        raise _Retry(
                            f"the server sent bytes {span[0]}-{span[1]}, not 0-{min(length, size) - 1}"
                        )
                elif status == 200:
                    size = int(response["ContentLength"])
                else:
                    raise _Retry(f"an HTTP {status} without a valid Content-Range")
                want = min(length, size)
                length_given = response.get("ContentLength")  # none for a chunked body
                if span is not None and length_given is not None and length_given != want:
                    raise _Retry(f"a Content-Length of {length_given}, not {want}")
                info = ObjectInfo(uri, size, response.get("ETag"))
                if info.etag is None and self.config.require_etag:
                    self._check_etag(info, None)
                data = bytearray()
                while len(data) < want:
                    chunk = await body.read(want - len(data))
                    if not chunk:
                        raise _Retry(f"short body: {len(data)} of {want} bytes")
                    data += chunk
            finally:
                body.close()
            self.bytes_fetched += len(data)
            return bytes(data), info

        return await self.retrying(uri, (0, length), once, nbytes=length, source_errors=True)

    async def get_bytes(
        self, info: ObjectInfo, begin: int, end: int, *, source_errors: bool = False
    ) -> bytes:
        """Bytes ``[begin, end)`` of the object the header read saw."""
        buffer = bytearray(end - begin)
        await self.read_into(info, begin, end, memoryview(buffer), source_errors=source_errors)
        return bytes(buffer)

    async def read_into(
        self, info: ObjectInfo, begin: int, end: int, view: memoryview, *, source_errors: bool = False
    ) -> None:
        """Writes bytes ``[begin, end)`` of the object into ``view``; a retry asks only for the bytes
        no verified response delivered."""
        uri = info.uri
        done = 0
        total = end - begin

        async def once() -> None:
            nonlocal done
            start = begin + done
            condition = _if_match(info.etag)
            options: dict[str, Any] = {"IfMatch": condition} if condition else {}
            self.requests += 1
            response = await self._client.get_object(
                Bucket=uri.bucket, Key=uri.key, Range=f"bytes={start}-{end - 1}", **options
            )
            body = response["Body"]
            received = 0
            trusted = False
            try:
                _check_encoding(response)
                span = content_range(response.get("ContentRange"))
                if span is not None and span[2] != info.size:
                    raise _Fatal(_CHANGED)
                if span is None and not (start == 0 and end == info.size):
                    raise _Retry("the server ignored the byte range, or sent no valid Content-Range")
                if span is not None and span[:2] != (start, end - 1):
                    raise _Retry(f"the server sent bytes {span[0]}-{span[1]}, not {start}-{end - 1}")
                length_given = response.get("ContentLength")  # none for a chunked body
                if length_given is not None and length_given != total - done:
                    raise _Retry(f"a Content-Length of {length_given}, not {total - done}")
                trusted = self._check_etag(info, response.get("ETag"))
                while done + received < total:
                    chunk = await body.read(total - done - received)
                    if not chunk:
                        raise _Retry(f"short body: the response ended {total - done - received} bytes early")
                    n = len(chunk)
                    view[done + received : done + received + n] = chunk
                    received += n
                    self.bytes_fetched += n
            finally:
                body.close()
                if trusted or done + received == total:
                    done += received

        await self.retrying(uri, (begin, end), once, nbytes=total, source_errors=source_errors)

    def connection(self) -> Connection:
        """A connection for ``fetch_into`` (one per worker; the caller closes it)."""
        c = self.config
        return Connection(lambda: self._ssl_context, c.connect_timeout, c.read_timeout)

    @functools.cached_property
    def _ssl_context(self) -> ssl.SSLContext:
        return ssl_context(self.config.ca_bundle, self.config.verify)

    async def _target(self, uri: S3Uri) -> Target:
        """The object's presigned GET URL, re-signed when half of its validity has passed."""
        now = time.monotonic()
        cached = self._targets.get(uri)
        if cached is None or now - cached[1] > _PRESIGN_SECONDS / 2:
            url = await self._client.generate_presigned_url(
                "get_object", Params={"Bucket": uri.bucket, "Key": uri.key}, ExpiresIn=_PRESIGN_SECONDS
            )
            cached = (Target.parse(url), now)
            self._targets[uri] = cached
        return cached[0]

    async def fetch_into(
        self,
        connection: Connection,
        info: ObjectInfo,
        begin: int,
        end: int,
        view: memoryview,
        *,
        until: float | None = None,
    ) -> None:
        """``read_into`` on the fast path: the body is received straight into ``view``."""
        uri = info.uri
        done = 0
        condition = _if_match(info.etag)
        headers = {"If-Match": condition} if condition else {}

        def verify(response_headers: Mapping[str, str]) -> bool:
            return self._check_etag(info, response_headers.get("etag"))

        async def once() -> None:
            nonlocal done
            target = await self._target(uri)
            self.requests += 1
            try:
                await connection.get(
                    target, begin + done, view[done:], headers, size=info.size, verify=verify
                )
            finally:
                done += connection.received
                self.bytes_fetched += connection.received

        await self.retrying(uri, (begin, end), once, nbytes=end - begin, until=until)

    async def get_object(self, uri: S3Uri) -> bytes:
        """A whole (small) object, e.g. an index file."""
        data, info = await self.get_start(uri, 1 << 20)
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

            async def once(options: dict[str, Any] = options) -> dict[str, Any]:
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


class ClientHolder:
    """The S3 client of one opened checkpoint: made on first use, reused by its runs, closed with
    the checkpoint (and made again if a closed checkpoint is read once more)."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self._client: S3Client | None = None
        self._lock = threading.Lock()

    def get(self) -> S3Client:
        with self._lock:
            if self._client is None or self._client.loop.is_closed():
                self._client = S3Client(self.config)
            return self._client

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


class S3Feeder:
    """Fetches the blocks of S3 files for one run and credits them to ``engine``.

    ``objects`` maps engine file indices to the objects they are. ``submit`` may be called from
    the run's thread at any time; ``close`` (before the engine closes) cancels what is queued or
    running and returns once no request can write into destination memory any more.
    """

    def __init__(self, client: S3Client, engine: native.Engine, objects: Mapping[int, ObjectInfo]) -> None:
        self._client = client
        self._engine = engine
        self._objects = dict(objects)
        self.error: S3Error | None = None
        self._queue: asyncio.Queue[native.Block] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._closed = False
        deadline = client.config.load_deadline
        self._until = None if deadline is None else time.monotonic() + deadline
        client.call(self._start(client.config.concurrency))

    async def _start(self, concurrency: int) -> None:
        self._queue = asyncio.Queue()
        self._workers = [asyncio.create_task(self._work()) for _ in range(concurrency)]

    def submit(self, blocks: Sequence[native.Block]) -> None:
        if self.error is not None:
            raise self.error
        batch = list(blocks)
        self._client.loop.call_soon_threadsafe(self._enqueue, batch)

    def _enqueue(self, blocks: list[native.Block]) -> None:
        assert self._queue is not None
        for block in blocks:
            self._queue.put_nowait(block)

    async def _work(self) -> None:
        connection = self._client.connection()
        try:
            await self._work_on(connection)
        finally:
            connection.close()

    async def _work_on(self, connection: Connection) -> None:
        assert self._queue is not None
        queue = self._queue
        while True:
            block = await queue.get()
            if self.error is not None:
                continue  # the run failed: drop the rest
            info = self._objects[block.file]
            # Only the credited bytes are needed: the planner's alignment padding is for O_DIRECT.
            begin, end = block.acc_begin, block.acc_end
            view = native.writable_view(block.dst + (begin - block.read_offset), end - begin)
            try:
                await self._client.fetch_into(connection, info, begin, end, view, until=self._until)
            except S3Error as error:
                self._fail(error, block)
                continue
            except Exception as exc:  # a bug must still end the run, never hang it
                self._fail(
                    S3Error(
                        f"unexpected failure: {type(exc).__name__}: {exc}",
                        bucket=info.uri.bucket,
                        key=info.uri.key,
                        byte_range=(begin, end),
                    ),
                    block,
                )
                continue
            finally:
                view.release()
            self._engine.credit(block)

    def _fail(self, error: S3Error, block: native.Block) -> None:
        if self.error is None:
            self.error = error
        self._engine.fail(
            native.ErrorInfo(
                native.ERR_EXTERNAL, 0, block.file, block.acc_begin, block.acc_end - block.acc_begin, 0
            )
        )

    def close(self) -> None:
        """Cancels every worker and waits until they are gone. Idempotent."""
        if not self._closed:
            self._closed = True
            self._client.call(self._stop())

    async def _stop(self) -> None:
        workers, self._workers = self._workers, []
        await _cancel_all(workers)

"""The client every HTTP object store shares: its event loop thread, tries bounded in time and
speed and retried with backoff, and ranged GETs received straight into destination memory.

A store subclasses ``ObjectStoreClient`` and supplies these, nothing else:

- ``sign(obj)``: where a GET of the object goes and how it is authorised (S3: a presigned URL;
  GCS: a bearer token);
- ``identity_headers(obj)`` and ``verify(obj, headers)``: the identity rule (S3: ``If-Match`` with
  the ETag the open saw, and the ETag of every answer compared with it);
- ``classify(exc)``: whether a failure is worth another try (``Retry``) or not (``Fatal``);
- ``error_type(failure, ...)``: the store's typed error for a failed request;
- the control plane an open needs: ``get_start``, ``get_object``, ``list_keys`` (and what a
  missing bucket and an empty prefix are called);
- ``release()``: closing what it opened on the loop (an SDK client).

The range-response check (status, ``Content-Range`` exactly the bytes asked for of an object of
the size the open saw, exact length, no encoding) is the same for every store (``response.py``).
Errors are raised outside ``except`` blocks, so no exception of a failed request (with its signed
headers) hangs on their chain.
"""

from __future__ import annotations

import abc
import asyncio
import email.utils
import functools
import random
import ssl
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from streamer.backends.http.connection import Connection, ssl_context
from streamer.backends.http.endpoint import Proxy, Target
from streamer.backends.http.objects import ObjectUri, StoredObject
from streamer.backends.http.response import HttpFailure
from streamer.backends.http.timing import LowSpeed, TooSlow, bounded
from streamer.errors import ObjectSourceError, ObjectStoreError
from streamer.host.collector import CollectorHold

T = TypeVar("T")

# How stores say "slow down": S3's 503 SlowDown, GCS's 429 rateLimitExceeded, Azure's 503 ServerBusy.
THROTTLE_STATUS = frozenset({429, 503})
THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
     "RequestThrottled", "ServerBusy", "rateLimitExceeded", "userRateLimitExceeded"}
)  # fmt: skip
COUNTERS = ("requests", "retries", "bytes_fetched", "throttles", "checked_objects")
COLLECTOR_HOLD_SECONDS = 10.0  # the longest an open holds garbage collection off (hold_collector)


class Retry(Exception):
    """One try failed in a way worth another."""

    def __init__(self, reason: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status, self.code = reason, status, code


class Fatal(Exception):
    """One try failed in a way no retry can fix."""

    def __init__(self, reason: str, status: int | None = None, code: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.status, self.code = reason, status, code


def retry_after(exc: Exception) -> float | None:
    """Seconds a throttled answer (429, 503) asked the client to wait in its ``Retry-After``
    header (a number of seconds, or an HTTP date), else None."""
    if not isinstance(exc, HttpFailure) or exc.status not in THROTTLE_STATUS:
        return None
    value = next((v.strip() for k, v in exc.headers.items() if k.lower() == "retry-after"), "")
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None  # not a date either: the client's own backoff applies
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


class RetrySettings(Protocol):
    """The bounds of every request (``S3Config`` has them; each store's config does)."""

    @property
    def min_rate(self) -> int: ...
    @property
    def attempt_allowance(self) -> float: ...
    @property
    def low_speed_window(self) -> float: ...
    @property
    def low_speed_tries(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def backoff_base(self) -> float: ...
    @property
    def backoff_max(self) -> float: ...
    @property
    def retry_deadline(self) -> float: ...
    @property
    def load_deadline(self) -> float | None: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def read_timeout(self) -> float: ...
    @property
    def ca_bundle(self) -> str | None: ...
    @property
    def verify(self) -> bool: ...
    @property
    def max_list_pages(self) -> int: ...


async def cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancels the tasks and waits until every one has ended.

    Cancelling again until they are gone: on Python < 3.12, ``asyncio.wait_for`` can swallow a
    cancellation that arrives as its inner future completes, and the task would then go on to
    wait on the block queue for ever.
    """
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.05)
    for task in tasks:
        if not task.cancelled():
            task.exception()


class ObjectStoreClient(abc.ABC):
    """One event loop on one background thread, its requests, and their counters.

    ``store`` names the store in metrics (``<store>_files``) and thread names; ``concurrency`` is
    how many ranged GETs a run keeps in flight (one connection each).
    """

    def __init__(self, settings: RetrySettings, store: str, concurrency: int) -> None:
        self.settings = settings
        self.store = store
        self.concurrency = concurrency
        self.requests = 0
        self.retries = 0
        self.bytes_fetched = 0
        self.throttles = 0  # retries of a try the store refused as throttled
        self.checked_objects = 0  # objects read whole whose store checksum matched (GCS's CRC32C)
        self._idle: list[Connection] = []  # the control plane's keep-alive connections
        self._proxies: dict[tuple[str, str], Proxy | None] = {}  # (scheme, netloc) -> its proxy
        self._collector_hold: CollectorHold | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"streamer-{store}", daemon=True)
        self._thread.start()

    def counters(self) -> tuple[int, int, int, int, int]:
        """``COUNTERS`` now: a feed's stats are what they grew by during its run."""
        return (self.requests, self.retries, self.bytes_fetched, self.throttles, self.checked_objects)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs ``coroutine`` on the loop and waits for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def hold_collector(self) -> None:
        """Holds automatic garbage collection off (``streamer.host.collector``) until this client's
        next run ends (``release_collector``), ``COLLECTOR_HOLD_SECONDS`` at most."""
        hold = CollectorHold()
        previous, self._collector_hold = self._collector_hold, hold
        if previous is not None:
            previous.release()
        self.loop.call_soon_threadsafe(self.loop.call_later, COLLECTOR_HOLD_SECONDS, hold.release)

    def release_collector(self) -> None:
        """Ends the hold of ``hold_collector``, if any (from any thread)."""
        hold, self._collector_hold = self._collector_hold, None
        if hold is not None:
            hold.release()

    def close(self) -> None:
        """Cancels running requests, closes the store's own resources, stops the thread. Idempotent."""
        self.release_collector()
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self.call(self._shutdown())
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join()
        self.loop.close()

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        await cancel_all([t for t in asyncio.all_tasks() if t is not current])
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        await self.release()
        await asyncio.sleep(0)  # let closed transports run their connection_lost callbacks

    # --- what a store supplies ------------------------------------------------------------

    @abc.abstractmethod
    async def release(self) -> None:
        """Closes what the store opened on the loop (an SDK client); called once, by ``close``."""

    @abc.abstractmethod
    async def sign(self, obj: StoredObject) -> tuple[Target, dict[str, str]]:
        """Where a GET of ``obj`` goes, and the headers that authorise it (none for a presigned URL)."""

    @abc.abstractmethod
    def identity_headers(self, obj: StoredObject) -> dict[str, str]:
        """Headers that make the server refuse a GET of another version of ``obj``."""

    @abc.abstractmethod
    def verify(self, obj: StoredObject, headers: Mapping[str, str]) -> bool:
        """Refuses (raises ``Fatal``) an answer from another version of ``obj``; True when the
        answer proved its version (a prefix of a later-broken body may then count)."""

    @abc.abstractmethod
    def classify(self, exc: Exception) -> Retry | Fatal:
        """What a failed try means."""

    @abc.abstractmethod
    def error_type(self, failure: Retry | Fatal, *, source_errors: bool) -> type[ObjectStoreError]:
        """The store's error type for a request that failed for good: ``failure`` is fatal, or the
        last of a retried request. ``source_errors``: a missing or forbidden object does not
        resolve the source (an ``ObjectSourceError``), rather than went away during a load."""

    def error(
        self,
        failure: Retry | Fatal,
        uri: ObjectUri,
        byte_range: tuple[int, int] | None,
        attempts: int,
        *,
        reason: str,
        source_errors: bool,
    ) -> ObjectStoreError:
        """The typed error naming ``uri`` (``reason`` says what failed, or why it gave up)."""
        kind = self.error_type(failure, source_errors=source_errors)
        return kind(
            reason,
            bucket=uri.bucket,
            key=uri.key,
            byte_range=byte_range,
            status=failure.status,
            code=failure.code,
            attempts=attempts,
            scheme=uri.scheme,
        )

    # --- the control plane: what opening a source needs -----------------------------------

    uri_type: ClassVar[type[ObjectUri]]  # the store's URIs
    header_bytes: int  # bytes fetched speculatively from the start of each file

    @abc.abstractmethod
    async def get_start(self, uri: ObjectUri, length: int) -> tuple[bytes, StoredObject]:
        """Up to ``length`` bytes from the start of the object, and the object (size, version)."""

    @abc.abstractmethod
    async def get_object(self, uri: ObjectUri, limit: int) -> bytes:
        """A whole small object (an index); ``ObjectSourceError`` when it is over ``limit`` bytes."""

    @abc.abstractmethod
    async def list_keys(self, bucket: str, prefix: str) -> list[str]:
        """Keys directly under ``prefix`` (not in sub-"directories"), sorted; bounded in pages."""

    @abc.abstractmethod
    def bucket_missing(self, error: ObjectSourceError) -> bool:
        """Whether a 404 said the bucket, not the object, is missing."""

    @abc.abstractmethod
    def source_error(self, message: str, uri: ObjectUri) -> ObjectSourceError:
        """The store's error for a source that does not resolve (an empty prefix)."""

    # --- requests (coroutines: run them on the loop) ---------------------------------------

    def attempt_seconds(self, nbytes: int) -> float:
        """How long one try for ``nbytes`` may take: the allowance, plus the bytes at the minimum rate."""
        return self.settings.attempt_allowance + nbytes / self.settings.min_rate

    async def retrying(
        self,
        uri: ObjectUri,
        byte_range: tuple[int, int] | None,
        once: Callable[[LowSpeed], Coroutine[Any, Any, T]],
        *,
        nbytes: int,
        source_errors: bool = False,
        until: float | None = None,
    ) -> T:
        """Runs ``once`` until it succeeds, fails for good, or runs out of tries or time.

        Each try is cut after ``attempt_seconds(nbytes)``, and sooner by the low-speed rule: once
        ``low_speed_window`` seconds of it moved less than ``min_rate`` per second (``once`` counts
        what it receives into its ``LowSpeed``); a request cut so ``low_speed_tries`` times fails.
        ``until`` (a ``time.monotonic()`` instant) cuts a try in flight and starts none after it.
        """
        c = self.settings
        started = time.monotonic()
        attempts = slow_tries = 0
        while True:
            attempts += 1
            speed = LowSpeed(c.min_rate, c.low_speed_window)
            budget = self.attempt_seconds(nbytes)
            cut_by_deadline = until is not None and until - time.monotonic() < budget
            if until is not None:
                budget = min(budget, until - time.monotonic())
            failure: Retry | Fatal
            asked: float | None = None
            tried = time.monotonic()
            try:
                if budget <= 0:
                    raise TimeoutError
                return await bounded(once(speed), budget, speed=speed)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failure = self.classify(exc)
                asked = retry_after(exc)
                if isinstance(exc, TooSlow):
                    slow_tries += 1
                    failure = Retry(
                        f"the try moved under {c.min_rate} bytes/s for {c.low_speed_window:g} s "
                        "(min_rate, low_speed_window)"
                    )
                elif isinstance(exc, TimeoutError) and time.monotonic() - tried >= budget:
                    if cut_by_deadline:
                        failure = Fatal(f"the load deadline of {c.load_deadline:g} s passed")
                    else:
                        failure = Retry(f"the try ran past its {budget:.3g} s (min_rate)")
            if isinstance(failure, Fatal):
                raise self.error(
                    failure, uri, byte_range, attempts, reason=failure.reason, source_errors=source_errors
                )
            delay = random.uniform(0.0, min(c.backoff_max, c.backoff_base * 2 ** (attempts - 1)))
            if isinstance(failure, Retry) and asked is not None:
                delay = max(delay, asked)  # a wait past the deadlines is not waited: it fails now
            out_of_time = time.monotonic() - started + delay > c.retry_deadline
            past_until = until is not None and time.monotonic() + delay >= until
            too_slow = slow_tries >= c.low_speed_tries
            if attempts >= c.max_attempts or out_of_time or past_until or too_slow:
                if past_until:
                    why = f"gave up at the load deadline of {c.load_deadline:g} s"
                elif too_slow:
                    why = f"gave up after {slow_tries} tries too slow"
                else:
                    why = f"gave up after {c.retry_deadline:g} s" if out_of_time else "gave up"
                if asked is not None and (out_of_time or past_until):
                    why += f" (the server asked to wait {asked:.3g} s more)"
                reason = f"{why}: {failure.reason}"
                raise self.error(failure, uri, byte_range, attempts, reason=reason, source_errors=False)
            self.retries += 1
            if failure.status in THROTTLE_STATUS or failure.code in THROTTLE_CODES:
                self.throttles += 1
            await asyncio.sleep(delay)

    async def get_bytes(
        self, obj: StoredObject, begin: int, end: int, *, source_errors: bool = False
    ) -> bytes:
        """Bytes ``[begin, end)`` of the object the header read saw, on a connection of their own."""
        buffer = bytearray(end - begin)
        connection = self.connection()
        try:
            await self.fetch_into(
                connection, obj, begin, end, memoryview(buffer), source_errors=source_errors
            )
        finally:
            connection.close()
        return bytes(buffer)

    async def plain_get(
        self, url: str, headers: Mapping[str, str], limit: int, speed: LowSpeed
    ) -> tuple[int, dict[str, str], bytes]:
        """A control-plane GET (a header read, a listing page) on an idle keep-alive connection, or
        a new one: the status, the headers and at most ``limit + 1`` body bytes."""
        connection = self._idle.pop() if self._idle else self.connection()
        try:
            status, body = await connection.request(
                Target.parse(url), headers, memoryview(bytearray(limit + 1)), speed=speed
            )
        except BaseException:
            connection.close()
            raise
        self._idle.append(connection)  # closed by the answer, it reconnects on its next use
        return status, connection.headers, body

    def connection(self) -> Connection:
        """A connection for ``fetch_into`` (one per worker; the caller closes it)."""
        c = self.settings
        return Connection(lambda: self._ssl_context, self.proxy_for, c.connect_timeout, c.read_timeout)

    def proxy_for(self, target: Target) -> Proxy | None:
        """The proxy the environment names for ``target``'s endpoint, looked up once per client:
        a lookup reads the whole environment (~0.25 ms), and a run opens a connection per worker."""
        key = (target.scheme, target.netloc)
        if key not in self._proxies:
            self._proxies[key] = Proxy.for_target(target)
        return self._proxies[key]

    @functools.cached_property
    def _ssl_context(self) -> ssl.SSLContext:
        return ssl_context(self.settings.ca_bundle, self.settings.verify)

    async def fetch_into(
        self,
        connection: Connection,
        obj: StoredObject,
        begin: int,
        end: int,
        view: memoryview,
        *,
        until: float | None = None,
        source_errors: bool = False,
    ) -> None:
        """Bytes ``[begin, end)`` of ``obj`` received straight into ``view``; a retry asks only for
        the bytes no verified response delivered."""
        done = 0
        headers = self.identity_headers(obj)

        def verify(response_headers: Mapping[str, str]) -> bool:
            return self.verify(obj, response_headers)

        async def once(speed: LowSpeed) -> None:
            nonlocal done
            target, authorization = await self.sign(obj)
            self.requests += 1
            try:
                await connection.get(
                    target,
                    begin + done,
                    view[done:],
                    {**headers, **authorization},
                    size=obj.size,
                    verify=verify,
                    speed=speed,
                )
            finally:
                done += connection.received
                self.bytes_fetched += connection.received

        await self.retrying(
            obj.uri, (begin, end), once, nbytes=end - begin, source_errors=source_errors, until=until
        )

"""Ranged HTTP/1.1 GETs whose bodies are received straight into destination memory.

The S3 data path. aiobotocore (aiohttp) hands a body over as ``bytes`` chunks of at most 64 KiB,
each then copied into place, plus several milliseconds of botocore machinery per request: on the
2-core machines we measure on that capped loads near 0.5 GB/s on one event loop thread, where a
``BufferedProtocol`` that lets the kernel ``recv_into`` the destination itself reaches ~2 GB/s.
So the backend signs each object's URL once with botocore (a SigV4 presigned GET URL: endpoint,
addressing style, region, credentials and session token all as the client resolved them) and
this module sends the GETs: one persistent keep-alive connection per worker, ``Range`` and
``If-Match`` headers, the status line and headers parsed here, the body written where it belongs.

Proxies: the ones the environment names (``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY``), chosen
by botocore's own rule, so the data GETs take the same path as the client's header reads and
listings. Plain ``http`` targets are asked for in absolute form; ``https`` ones go through a
``CONNECT`` tunnel with TLS end to end. Only ``http://`` proxies are supported.

Every success is checked before a body byte lands: status, ``Content-Range`` (exactly the bytes
asked for, of an object of the size expected), ``Content-Length`` (strict: duplicates must agree),
no ``Content-Encoding``, then the caller's ``verify`` of the headers (the ETag). Interim ``1xx``
answers are skipped, chunked bodies decoded into place (only their framing is copied), bodies
without a length read to the close. Nothing here retries or knows S3 semantics beyond reading an
error's ``<Code>``, ``<Endpoint>`` and ``<Region>``; failures are ``HttpFailure`` (an error
status), ``ProtocolViolation`` (an answer that breaks HTTP or is not the range asked for),
``SizeChanged``, ``ProxyError`` (the proxy refused the tunnel) or ``OSError`` / ``TimeoutError``
(the connection broke or stalled), and ``received`` tells the caller how many body bytes count.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import re
import socket
import ssl
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

T = TypeVar("T")
_HEAD_LIMIT = 64 * 1024
_SCRATCH = 64 * 1024
_LINE_LIMIT = 4096
_ERROR_BODY_LIMIT = 64 * 1024
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})")
_DIGITS = re.compile(r"[0-9]{1,20}")
_HEX = re.compile(r"[0-9a-fA-F]{1,16}")
_STATUS = re.compile(r"[0-9]{3}")
# the states of one response
_HEAD, _BODY, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _ERROR = range(7)


@dataclass(frozen=True)
class Target:
    """Where a presigned URL points: connection parameters and the request target."""

    scheme: str
    host: str
    port: int
    netloc: str  # the Host header, exactly as signed
    target: str  # path?query

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"unsupported endpoint scheme {parts.scheme!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        return cls(parts.scheme, parts.hostname, port, parts.netloc, target)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.netloc}{self.target}"


@dataclass(frozen=True)
class Proxy:
    """An ``http://`` proxy and the ``Proxy-Authorization`` its URL's user:password give."""

    host: str
    port: int
    authorization: str | None

    @classmethod
    def for_target(cls, target: Target) -> Proxy | None:
        """The proxy the environment names for ``target``, by botocore's rule (NO_PROXY included)."""
        from botocore.utils import get_environ_proxies

        url = get_environ_proxies(target.url).get(target.scheme)
        if not url:
            return None
        if "://" not in url:  # "proxy:3128" or "//proxy:3128", as botocore accepts them
            url = "http://" + url.removeprefix("//")
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            where = parts.hostname or "?"
            raise UnsupportedProxy(f"unsupported proxy {parts.scheme}://{where}: only http:// proxies work")
        authorization = None
        if parts.username is not None:
            secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            authorization = "Basic " + base64.b64encode(secret).decode("ascii")
        return cls(parts.hostname, parts.port or 80, authorization)


class UnsupportedProxy(ValueError):
    """The environment names a proxy this client cannot use (not ``http://``)."""


class ProxyError(ConnectionError):
    """The proxy answered a ``CONNECT`` with something other than success."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(f"the proxy refused the tunnel: {line}")
        self.status = status


class HttpFailure(Exception):
    """The server answered, but not with the bytes asked for."""

    def __init__(
        self,
        status: int,
        code: str | None,
        headers: Mapping[str, str],
        fields: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"HTTP {status}" + (f" {code}" if code else ""))
        self.status = status
        self.code = code
        self.headers = dict(headers)
        self.fields = dict(fields or {})  # <Endpoint>, <Region> of the error body, where present


class ProtocolViolation(Exception):
    """The answer breaks HTTP/1.1 or is not the range asked for; ``fatal``: no retry can help."""

    def __init__(self, reason: str, *, fatal: bool = False) -> None:
        super().__init__(reason)
        self.fatal = fatal


class SizeChanged(Exception):
    """The ``Content-Range`` total is not the object size the header read saw."""


Verify = Callable[[Mapping[str, str]], bool]


def content_range(text: str | None) -> tuple[int, int, int] | None:
    """``(first, last, size)`` of ``bytes first-last/size``, or ``None`` when it is not exactly that."""
    match = _RANGE.fullmatch((text or "").strip())
    if match is None:
        return None
    first, last, size = (int(group) for group in match.groups())
    return (first, last, size) if first <= last < size else None


def content_length(headers: Mapping[str, str]) -> int | None:
    """The ``Content-Length``; duplicates (joined with commas) must agree. Raises on garbage."""
    text = headers.get("content-length")
    if text is None:
        return None
    values = {value.strip() for value in text.split(",")}
    if len(values) != 1 or not all(_DIGITS.fullmatch(value) for value in values):
        raise ProtocolViolation(f"a malformed or conflicting Content-Length: {text[:40]!r}")
    return int(values.pop())


class _Response(asyncio.BufferedProtocol):
    """One connection; reads one response at a time.

    A success's head (status, ``Content-Range``, ``Content-Length``, encoding, then the caller's
    ``verify``) is checked before any body byte is written; the body is then received straight
    into ``dst`` (chunked bodies: their data, while the framing goes through a scratch buffer).
    Parse failures end the request's future, never escape a protocol callback.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(_SCRATCH)
        self._pending = bytearray()  # received, not yet parsed (head, chunk framing, error body)
        self._dst: memoryview | None = None
        self._begin = 0
        self._size = 0
        self._verify: Verify | None = None
        self._state = _HEAD
        self._chunk_left = 0
        self._direct = False  # the last get_buffer handed out destination memory
        self.received = 0  # body bytes written into dst by the current request
        self.trusted = False  # the head proved the object version: a received prefix may count
        self.activity = 0  # bumps on every read: the stall watchdog's clock
        self._speed: LowSpeed | None = None  # the current try's byte count, for the low-speed rule
        self.status = 0
        self.headers: dict[str, str] = {}
        self._error_length = -1
        self._done: asyncio.Future[None] | None = None
        self.closed = False
        self.keep_alive = True

    # --- the request side ---------------------------------------------------------------------

    def start(
        self, dst: memoryview, begin: int, size: int, verify: Verify, speed: LowSpeed | None
    ) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        self._dst, self._begin, self._size, self._verify = dst, begin, size, verify
        self._speed = speed
        self._pending.clear()
        self._state = _HEAD
        self.received = 0
        self.trusted = False
        self.status = 0
        self.headers = {}
        self._done = loop.create_future()
        if self.closed:
            self._done.set_exception(ConnectionResetError("connection closed"))
        return self._done

    @property
    def _want(self) -> int:
        return len(self._dst) if self._dst is not None else 0

    # --- BufferedProtocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        self._direct = False
        if self._dst is not None and not self._pending and self._running():
            left = self._want - self.received
            if self._state == _BODY and left > 0:
                self._direct = True
                return self._dst[self.received :]  # the body: straight into place
            if self._state == _CHUNK_DATA and 0 < self._chunk_left <= left:
                self._direct = True
                return self._dst[self.received : self.received + self._chunk_left]
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        self.activity += 1
        if self._speed is not None:
            self._speed.moved += nbytes
        if not self._running():
            if nbytes:  # bytes nobody asked for: the connection is out of step
                self.keep_alive = False
                self._abort()
            return
        if self._direct:
            self.received += nbytes
            if self._state == _BODY:  # the hot path: nothing to parse
                if self.received >= self._want:
                    self._finish()
                return
            if self._state == _CHUNK_DATA:
                self._chunk_left -= nbytes
                if self._chunk_left == 0:
                    self._state = _CHUNK_END
        else:
            self._pending += self._scratch[:nbytes]
        try:
            self._parse()
        except Exception as exc:  # a broken answer, or the caller's verify refusing the head
            self._fail(exc)

    def eof_received(self) -> bool:
        self._lost(ConnectionResetError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost(exc if exc is not None else ConnectionResetError("connection closed"))

    # --- parsing ------------------------------------------------------------------------------

    def _running(self) -> bool:
        return self._done is not None and not self._done.done()

    def _parse(self) -> None:
        while self._running():
            if self._state == _HEAD:
                if not self._parse_head():
                    return
            elif self._state == _BODY:
                self._take(len(self._pending))
                if self.received >= self._want:
                    if self._pending:  # more than the Content-Range said: never reuse this connection
                        self.keep_alive = False
                    self._finish()
                return
            elif self._state == _ERROR:
                self._collect_error()
                return
            elif not self._parse_chunked():
                return

    def _parse_head(self) -> bool:
        end = self._pending.find(b"\r\n\r\n")
        if end < 0:
            if len(self._pending) > _HEAD_LIMIT:
                raise ProtocolViolation(f"response headers longer than {_HEAD_LIMIT // 1024} KiB")
            return False
        if end > _HEAD_LIMIT:
            raise ProtocolViolation(f"response headers longer than {_HEAD_LIMIT // 1024} KiB")
        lines = bytes(self._pending[:end]).decode("latin-1").split("\r\n")
        del self._pending[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or parts[0] not in ("HTTP/1.1", "HTTP/1.0") or not _STATUS.fullmatch(parts[1]):
            raise ProtocolViolation(f"not an HTTP/1.1 response: {lines[0][:40]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            if status == 101:
                raise ProtocolViolation("the server switched protocols", fatal=True)
            return True  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            key = name.strip().lower()
            if not colon or not key:
                raise ProtocolViolation(f"a malformed header line: {line[:40]!r}")
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        self.status, self.headers = status, headers
        if headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0":
            self.keep_alive = False
        if status in (200, 206):
            self._accept_success(status, headers)
        else:
            self._state = _ERROR
            length: int | None = None
            if "transfer-encoding" not in headers:
                with contextlib.suppress(ProtocolViolation):  # an error's framing: read until the close
                    length = content_length(headers)
            self._error_length = -1 if length is None else length
            if length is None:
                self.keep_alive = False  # read until the server closes (or the chunked end), then parse
        return True

    def _accept_success(self, status: int, headers: Mapping[str, str]) -> None:
        """Checks a 200/206 head against the request; sets up the body's framing."""
        want, begin = self._want, self._begin
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise ProtocolViolation(
                f"the server encoded the body (Content-Encoding: {encoding[:40]})", fatal=True
            )
        transfer = headers.get("transfer-encoding")
        length = content_length(headers)
        if transfer is not None:
            if transfer.strip().lower() != "chunked":
                raise ProtocolViolation(f"an unsupported Transfer-Encoding: {transfer[:40]!r}")
            if length is not None:
                raise ProtocolViolation("both Transfer-Encoding and Content-Length")
        if status == 206:
            text = headers.get("content-range")
            span = content_range(text)
            if span is None:
                raise ProtocolViolation(f"a 206 without a valid Content-Range: {(text or '')[:60]!r}")
            if span[2] != self._size:
                raise SizeChanged(f"the object is {span[2]} bytes now, not {self._size}")
            if span[:2] != (begin, begin + want - 1):
                asked = f"{begin}-{begin + want - 1}"
                raise ProtocolViolation(f"the server sent bytes {span[0]}-{span[1]}, not {asked}")
        elif begin != 0 or want != self._size:
            raise ProtocolViolation("the server ignored the byte range (200 for a ranged GET)")
        if length is not None and length != want:
            raise ProtocolViolation(f"a Content-Length of {length}, not the {want} bytes asked for")
        assert self._verify is not None
        self.trusted = self._verify(headers)
        if transfer is not None:
            self._state = _CHUNK_SIZE
        else:
            self._state = _BODY
            if length is None:
                self.keep_alive = False  # close-delimited: the connection ends with the body

    def _take(self, n: int) -> None:
        """Moves ``n`` pending bytes into the destination."""
        assert self._dst is not None
        take = min(n, self._want - self.received)
        self._dst[self.received : self.received + take] = self._pending[:take]
        self.received += take
        del self._pending[:take]

    def _parse_chunked(self) -> bool:
        """One step of the chunked framing; False when it needs more bytes."""
        if self._state == _CHUNK_DATA:
            if not self._pending:
                return False
            n = min(len(self._pending), self._chunk_left)
            self._take(n)
            self._chunk_left -= n
            if self._chunk_left == 0:
                self._state = _CHUNK_END
            return True
        if self._state == _CHUNK_END:
            if len(self._pending) < 2:
                return False
            if self._pending[:2] != b"\r\n":
                raise ProtocolViolation("a chunk longer than its size line says")
            del self._pending[:2]
            self._state = _CHUNK_SIZE
            return True
        end = self._pending.find(b"\r\n")
        if end < 0:
            if len(self._pending) > _LINE_LIMIT:
                raise ProtocolViolation("a chunk size or trailer line without an end")
            return False
        line = bytes(self._pending[:end]).decode("latin-1")
        del self._pending[: end + 2]
        if self._state == _TRAILER:
            if not line:
                if self.received != self._want:
                    raise ProtocolViolation(f"a chunked body of {self.received} bytes, not {self._want}")
                self._finish()
                return False
            return True
        size_text = line.partition(";")[0].strip()
        if not _HEX.fullmatch(size_text):
            raise ProtocolViolation(f"a malformed chunk size: {line[:40]!r}")
        size = int(size_text, 16)
        if size == 0:
            self._state = _TRAILER
        elif self.received + size > self._want:
            raise ProtocolViolation("a chunked body longer than the range asked for")
        else:
            self._chunk_left, self._state = size, _CHUNK_DATA
        return True

    def _collect_error(self) -> None:
        body = self._pending
        if len(body) > _ERROR_BODY_LIMIT:
            self.keep_alive = False
            self._finish_error()
        elif 0 <= self._error_length <= len(body) or body.endswith(b"0\r\n\r\n"):
            self._finish_error()

    def _finish_error(self) -> None:
        body = bytes(self._pending)
        match = _CODE.search(body)
        code = match.group(1).decode("ascii", "replace") if match else None
        fields = {}
        for name in ("Endpoint", "Region"):
            found = re.search(rb"<" + name.encode() + rb">([^<]{1,256})</" + name.encode() + rb">", body)
            if found:
                fields[name] = found.group(1).decode("ascii", "replace")
        self._fail(HttpFailure(self.status, code, self.headers, fields))

    def _finish(self) -> None:
        if self._running():
            assert self._done is not None
            self._done.set_result(None)

    def _lost(self, exc: Exception) -> None:
        if not self._running():
            return
        if self._state == _ERROR:
            self._finish_error()  # an error body that ran until the close
        elif self._state == _BODY and self.received >= self._want:
            self._finish()
        else:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if self._running():
            assert self._done is not None
            self.keep_alive = False
            self._done.set_exception(exc)

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Connection:
    """A keep-alive HTTP/1.1 connection to one endpoint, reopened when it breaks."""

    def __init__(
        self, ssl_context: Callable[[], ssl.SSLContext], connect_timeout: float, read_timeout: float
    ) -> None:
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._where: tuple[str, str, int] | None = None
        self._protocol: _Response | None = None
        self._proxy: Proxy | None = None  # the proxy of the open connection
        self.received = 0  # body bytes the last get() wrote
        self.headers: dict[str, str] = {}  # response headers of the last get()

    async def get(
        self,
        target: Target,
        begin: int,
        dst: memoryview,
        headers: Mapping[str, str],
        *,
        size: int,
        verify: Verify,
        speed: LowSpeed | None = None,
    ) -> None:
        """GETs ``len(dst)`` bytes from ``begin`` of a ``size``-byte object into ``dst``.

        ``verify`` sees a success's headers before any body byte lands; it raises to refuse them
        and returns whether a prefix received before a later failure may count. On failure
        ``received`` says how many bytes of ``dst`` count (0 unless the head was trusted).
        Every byte received (head and body) is added to ``speed``.
        """
        self.received = 0
        self.headers = {}
        protocol = await self._open(target)
        assert protocol.transport is not None
        end = begin + len(dst) - 1
        forwarder = self._proxy if target.scheme == "http" else None  # tunnels carry origin form
        lines = [
            f"GET {target.url if forwarder else target.target} HTTP/1.1",
            f"Host: {target.netloc}",
            f"Range: bytes={begin}-{end}",
            "Accept-Encoding: identity",
            "User-Agent: streamer",
        ]
        if forwarder is not None and forwarder.authorization:
            lines.append(f"Proxy-Authorization: {forwarder.authorization}")
        lines += [f"{name}: {value}" for name, value in headers.items()]
        done = protocol.start(dst, begin, size, verify, speed)
        protocol.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        try:
            await self._wait(protocol, done)
        except BaseException:
            self.received = protocol.received if protocol.trusted else 0
            self.close()  # a half-read response leaves the connection out of step
            _settle(done)
            raise
        self.received = protocol.received
        self.headers = protocol.headers
        if not protocol.keep_alive:
            self.close()

    async def _wait(self, protocol: _Response, done: asyncio.Future[None]) -> None:
        """Waits for the response, failing with TimeoutError after read_timeout without a byte."""
        while True:
            seen = protocol.activity
            try:
                await asyncio.wait_for(asyncio.shield(done), self._read_timeout)
                return
            except (asyncio.TimeoutError, TimeoutError):
                if done.done():
                    done.result()
                    return
                if protocol.activity == seen:
                    done.cancel()
                    raise TimeoutError(f"no data for {self._read_timeout:g} s") from None

    async def _open(self, target: Target) -> _Response:
        where = (target.scheme, target.host, target.port)
        protocol = self._protocol
        if protocol is not None and (protocol.closed or where != self._where):
            self.close()
            protocol = None
        if protocol is None:
            proxy = Proxy.for_target(target)
            protocol = await bounded(self._connect(target, proxy), self._connect_timeout, discard=_abort)
            self._protocol, self._where, self._proxy = protocol, where, proxy
        assert protocol is not None
        return protocol

    async def _connect(self, target: Target, proxy: Proxy | None) -> _Response:
        loop = asyncio.get_running_loop()
        use_ssl = self._ssl() if target.scheme == "https" else None  # loading CAs costs 0.1 s
        if proxy is None:
            hostname = target.host if use_ssl else None
            _, protocol = await loop.create_connection(
                _Response, target.host, target.port, ssl=use_ssl, server_hostname=hostname
            )
        elif use_ssl is None:
            _, protocol = await loop.create_connection(_Response, proxy.host, proxy.port)
        else:
            tunnel = await _tunnel(proxy, target)
            try:
                _, protocol = await loop.create_connection(
                    _Response, sock=tunnel, ssl=use_ssl, server_hostname=target.host
                )
            except BaseException:
                tunnel.close()
                raise
        return protocol

    def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abort()  # no lingering FIN_WAIT; nothing more is sent anyway


class LowSpeed:
    """curl's low-speed rule for one try: it is too slow once some ``window`` seconds of it moved
    fewer than ``rate * window`` bytes. The try adds what it receives to ``moved``; a server that
    trickles a byte at a time never lets a read time out, and this still cuts it."""

    def __init__(self, rate: int, window: float) -> None:
        self.rate = rate
        self.window = window
        self.moved = 0
        self._marks: collections.deque[tuple[float, int]] = collections.deque()

    def too_slow(self, now: float) -> bool:
        """Called every ``step`` seconds or so while the try runs."""
        marks = self._marks
        marks.append((now, self.moved))
        while len(marks) > 1 and marks[1][0] <= now - self.window:
            marks.popleft()
        since, moved = marks[0]
        return now - since >= self.window and self.moved - moved < self.rate * self.window

    @property
    def step(self) -> float:
        return self.window / 10


class TooSlow(TimeoutError):
    """A try cut by the low-speed rule (``LowSpeed``)."""


async def bounded(
    coroutine: Coroutine[Any, Any, T],
    seconds: float,
    *,
    discard: Callable[[T], None] | None = None,
    speed: LowSpeed | None = None,
) -> T:
    """``coroutine``'s result, or ``TimeoutError`` after ``seconds``, or ``TooSlow`` once ``speed``
    says so (it is then cancelled).

    Unlike ``asyncio.wait_for`` on Python < 3.12, an exception the coroutine raises as the caller
    is cancelled is still retrieved: no "Task exception was never retrieved" at shutdown. A result
    that arrives as the caller is cancelled goes to ``discard`` (a connection that would else stay
    open, unowned, for as long as the process lives).
    """
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coroutine)
    interrupted = slow = False
    until = loop.time() + seconds
    try:
        if speed is not None:
            speed.too_slow(loop.time())
        while not task.done() and loop.time() < until and not slow:
            left = until - loop.time()
            await asyncio.wait({task}, timeout=left if speed is None else min(left, speed.step))
            slow = speed is not None and not task.done() and speed.too_slow(loop.time())
    except asyncio.CancelledError:
        interrupted = True
    while not task.done():  # cancelled again while it winds down: it still ends before we do
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=0.05)
        except asyncio.CancelledError:
            interrupted = True
    if not task.cancelled():
        task.exception()
    if interrupted:
        if discard is not None and not task.cancelled() and task.exception() is None:
            discard(task.result())
        raise asyncio.CancelledError
    if task.cancelled():
        if slow:
            assert speed is not None
            raise TooSlow(f"under {speed.rate} bytes/s for {speed.window:g} s")
        raise TimeoutError(f"no answer within {seconds:.3g} s")
    return task.result()


def _abort(protocol: _Response) -> None:
    """Closes a connection nobody will use."""
    if protocol.transport is not None:
        protocol.transport.abort()


def _settle(done: asyncio.Future[None]) -> None:
    """Ends a request's future that nobody will await: no "exception was never retrieved"."""
    if not done.done():
        done.cancel()
    elif not done.cancelled():
        done.exception()


async def _tunnel(proxy: Proxy, target: Target) -> socket.socket:
    """A socket connected to ``target`` through ``proxy``'s ``CONNECT``, for TLS to run over."""
    loop = asyncio.get_running_loop()
    tunnel: socket.socket | None = None
    failure: OSError = OSError(f"the proxy {proxy.host} has no address")
    addresses = await loop.getaddrinfo(proxy.host, proxy.port, type=socket.SOCK_STREAM)
    for family, kind, proto, _, address in addresses:
        candidate = socket.socket(family, kind, proto)
        candidate.setblocking(False)
        try:
            await loop.sock_connect(candidate, address)
        except OSError as exc:
            candidate.close()
            failure = exc
            continue
        except BaseException:
            candidate.close()
            raise
        tunnel = candidate
        break
    if tunnel is None:
        raise failure
    try:
        lines = [f"CONNECT {target.host}:{target.port} HTTP/1.1", f"Host: {target.host}:{target.port}"]
        if proxy.authorization:
            lines.append(f"Proxy-Authorization: {proxy.authorization}")
        await loop.sock_sendall(tunnel, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        reply = b""
        while b"\r\n\r\n" not in reply:  # the server speaks first in no TLS version: no bytes follow
            chunk = await loop.sock_recv(tunnel, 4096)
            if not chunk:
                raise ConnectionError("the proxy closed the connection during CONNECT")
            reply += chunk
            if len(reply) > _HEAD_LIMIT:
                raise ConnectionError("the proxy's CONNECT reply has no end")
        line = reply.split(b"\r\n", 1)[0].decode("latin-1")
        fields = line.split(" ", 2)
        status = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0
        if not 200 <= status < 300:
            raise ProxyError(status, line)
    except BaseException:
        tunnel.close()
        raise
    return tunnel


def ssl_context(ca_bundle: str | None, verify: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_bundle if verify else None)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context

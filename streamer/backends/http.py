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

Nothing here retries or knows S3 semantics beyond reading an error's ``<Code>``; failures are
``HttpFailure`` (an answer that is not the bytes asked for), ``ProxyError`` (the proxy refused
the tunnel) or ``OSError`` / ``TimeoutError`` (the connection broke or stalled), and
``received`` tells the caller how far the body got.
"""

from __future__ import annotations

import asyncio
import base64
import re
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

_HEAD_LIMIT = 64 * 1024
_ERROR_BODY_LIMIT = 64 * 1024
_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")


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

    def __init__(self, status: int, code: str | None, headers: Mapping[str, str]) -> None:
        super().__init__(f"HTTP {status}" + (f" {code}" if code else ""))
        self.status = status
        self.code = code
        self.headers = dict(headers)


class _Response(asyncio.BufferedProtocol):
    """One connection; reads one response at a time, its body into ``dst`` when it is a success."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._head = bytearray(_HEAD_LIMIT)
        self._head_len = 0
        self._dst: memoryview | None = None
        self._want = 0
        self.received = 0  # body bytes written into dst by the current request
        self.activity = 0  # bumps on every read: the stall watchdog's clock
        self.status = 0
        self.headers: dict[str, str] = {}
        self._error_body: bytearray | None = None
        self._error_length = 0
        self._done: asyncio.Future[None] | None = None
        self.closed = False
        self.keep_alive = True

    # --- the request side ---------------------------------------------------------------------

    def start(self, dst: memoryview) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        self._dst = dst
        self._want = len(dst)
        self.received = 0
        self._head_len = 0
        self.status = 0
        self.headers = {}
        self._error_body = None
        self._done = loop.create_future()
        if self.closed:
            self._done.set_exception(ConnectionResetError("connection closed"))
        return self._done

    # --- BufferedProtocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.status and self._error_body is None and self._dst is not None and self.received < self._want:
            return self._dst[self.received :]  # the body: straight into place
        if self._head_len >= len(self._head):
            self._head.extend(bytes(len(self._head)))  # error bodies can outgrow the first buffer
        return memoryview(self._head)[self._head_len :]

    def buffer_updated(self, nbytes: int) -> None:
        self.activity += 1
        if self._done is None or self._done.done():
            if nbytes:  # bytes nobody asked for: the connection is out of step
                self.keep_alive = False
                self._abort()
            return
        if self.status and self._error_body is None:
            self.received += nbytes
        else:
            self._head_len += nbytes
            if not self.status:
                self._parse_head()
            elif self._error_body is not None:
                self._collect_error()
        self._maybe_done()

    def eof_received(self) -> bool:
        self._lost(ConnectionResetError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost(exc if exc is not None else ConnectionResetError("connection closed"))

    # --- parsing ------------------------------------------------------------------------------

    def _parse_head(self) -> None:
        end = self._head.find(b"\r\n\r\n", 0, self._head_len)
        if end < 0:
            if self._head_len >= _HEAD_LIMIT:
                self._fail(ConnectionResetError("response headers too long"))
            return
        lines = bytes(self._head[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            self._fail(ConnectionResetError(f"not an HTTP response: {lines[0][:40]!r}"))
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.status = int(parts[1])
        self.headers = headers
        if headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0":
            self.keep_alive = False
        rest = bytes(self._head[end + 4 : self._head_len])
        self._head_len = 0
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if self.status in (200, 206) and not chunked and length is not None:
            if int(length) != self._want:
                self.keep_alive = False
                self._fail(HttpFailure(self.status, "UnexpectedLength", headers))
                return
            assert self._dst is not None
            take = min(len(rest), self._want)
            self._dst[:take] = rest[:take]
            self.received = take
            if len(rest) > take:
                self.keep_alive = False
            return
        # An error (or a success we cannot use): keep its body, up to a limit, for <Code>.
        self._error_body = bytearray(rest)
        self._error_length = int(length) if length is not None and length.isdigit() else -1
        if chunked or self._error_length < 0:
            self.keep_alive = False  # read until the server closes, then parse what came
        self._collect_error()

    def _collect_error(self) -> None:
        assert self._error_body is not None
        if self._head_len:
            self._error_body += self._head[: self._head_len]
            self._head_len = 0
        if len(self._error_body) > _ERROR_BODY_LIMIT:
            self.keep_alive = False
            self._finish_error()

    def _finish_error(self) -> None:
        body = bytes(self._error_body or b"")
        match = _CODE.search(body)
        code = match.group(1).decode("ascii", "replace") if match else None
        self._fail(HttpFailure(self.status, code, self.headers))

    def _maybe_done(self) -> None:
        if self._done is None or self._done.done() or not self.status:
            return
        if self._error_body is not None:
            if 0 <= self._error_length <= len(self._error_body):
                self._finish_error()
            return
        if self.received >= self._want:
            self._done.set_result(None)

    def _lost(self, exc: Exception) -> None:
        if self._done is not None and not self._done.done():
            if self._error_body is not None and self.status:
                self._finish_error()  # an error body that ran until the close
            else:
                self._done.set_exception(exc)

    def _fail(self, exc: Exception) -> None:
        if self._done is not None and not self._done.done():
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

    async def get(self, target: Target, begin: int, dst: memoryview, headers: Mapping[str, str]) -> None:
        """GETs ``len(dst)`` bytes from ``begin`` into ``dst``. On failure ``received`` says how many
        landed (a prefix of ``dst``)."""
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
        done = protocol.start(dst)
        protocol.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        try:
            await self._wait(protocol, done)
        except BaseException:
            self.received = protocol.received
            self.close()  # a half-read response leaves the connection out of step
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
            protocol = await asyncio.wait_for(self._connect(target, proxy), self._connect_timeout)
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

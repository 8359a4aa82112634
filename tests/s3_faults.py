"""A fault-injecting HTTP proxy on 127.0.0.1 for the S3 tests.

Every request is forwarded to the upstream S3 server (moto) unchanged (so SigV4 still verifies);
a request that matches a queued fault gets that fault instead of (or on top of) the real answer:

- ``503`` / ``429`` / ``500``: an S3 XML error (SlowDown, TooManyRequests, InternalError); ``503+N``
  the same with ``Retry-After: N``;
- ``401`` / ``403`` / ``404``: Unauthorized / AccessDenied / NoSuchKey;
- ``reset``: the real status line, headers and part of the body, then a TCP reset;
- ``short``: the real headers (full Content-Length) and part of the body, then a clean close;
- ``stall``: the real headers and part of the body, then silence for ``stall_seconds``.

Faults are queued with ``inject(kind, times=N)`` ("N times, then success"); ``times=None`` makes
it persistent. Only ranged GETs of tensor data are hit by default (the ``match`` predicate gets
the method, the path and the headers). Responses always close the connection.

It is also a forward proxy, as ``HTTP_PROXY`` names one: a request in absolute form
(``GET http://host/path``) is sent upstream in origin form, and ``CONNECT`` opens a tunnel to the
upstream (whatever host it names: everything here is on loopback). ``proxied`` counts both and
``proxy_authorizations`` keeps their ``Proxy-Authorization`` values; with ``require_authorization``
set, a ``CONNECT`` without that value gets ``407``.
"""

from __future__ import annotations

import http.client
import select
import socket
import socketserver
import ssl
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

Match = Callable[[str, str, Mapping[str, str]], bool]

_ERRORS = {
    "503": (503, "Service Unavailable", "SlowDown", "Please reduce your request rate."),
    "429": (429, "Too Many Requests", "TooManyRequests", "Too many requests."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "401": (401, "Unauthorized", "Unauthorized", "The credentials were refused."),
    "403": (403, "Forbidden", "AccessDenied", "Access Denied"),
    "404": (404, "Not Found", "NoSuchKey", "The specified key does not exist."),
}


def data_gets(method: str, path: str, headers: Mapping[str, str]) -> bool:
    """Ranged GETs past the header read (whose range starts at byte 0)."""
    rng = headers.get("range", "")
    return method == "GET" and rng.startswith("bytes=") and not rng.startswith("bytes=0-")


def any_get(method: str, path: str, headers: Mapping[str, str]) -> bool:
    return method == "GET"


class LoopbackServer:
    """A threaded TCP server on 127.0.0.1 that runs ``handle`` on each accepted socket."""

    def __init__(self, handle: Callable[[socket.socket], None], name: str) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                handle(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = False  # server_close() joins the handlers: none outlives close()
            allow_reuse_address = True
            block_on_close = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def relay(one: socket.socket, other: socket.socket, stop: threading.Event) -> None:
    """Copies bytes both ways until either side closes or ``stop`` is set."""
    try:
        while not stop.is_set():
            # A TLS socket may hold decrypted bytes that select() cannot see: those go first.
            pending = [end for end in (one, other) if isinstance(end, ssl.SSLSocket) and end.pending()]
            for end in pending or select.select([one, other], [], [], 0.2)[0]:
                data = end.recv(65536)
                if not data:
                    return
                (other if end is one else one).sendall(data)
    except OSError:
        return


@dataclass
class _Fault:
    kind: str
    times: int | None
    match: Match


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    stall_seconds: float = 5.0
    faults: list[_Fault] = field(default_factory=list)
    injected: int = 0
    requests: int = 0
    proxied: int = 0
    proxy_authorizations: list[str] = field(default_factory=list)
    require_authorization: str | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = LoopbackServer(self._handle, "fault-proxy")

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.address
        return f"http://{host}:{port}"

    def inject(self, kind: str, *, times: int | None = 1, match: Match = data_gets) -> None:
        with self._lock:
            self.faults.append(_Fault(kind, times, match))

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.injected = 0
            self.requests = 0
            self.proxied = 0
            self.proxy_authorizations.clear()

    def close(self) -> None:
        self._stop.set()
        self._server.close()

    def _take(self, method: str, path: str, headers: Mapping[str, str]) -> str | None:
        with self._lock:
            self.requests += 1
            for fault in self.faults:
                if fault.times != 0 and fault.match(method, path, headers):
                    if fault.times is not None:
                        fault.times -= 1
                    self.injected += 1
                    return fault.kind
        return None

    def _handle(self, client: socket.socket) -> None:
        reader = client.makefile("rb")
        request_line = reader.readline().decode("latin-1").rstrip("\r\n")
        if not request_line:
            return
        method, path, _ = request_line.split(" ", 2)
        headers: list[tuple[str, str]] = []
        while True:
            line = reader.readline().decode("latin-1").rstrip("\r\n")
            if not line:
                break
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
        lower = {k.lower(): v for k, v in headers}
        if "://" in path or method == "CONNECT":
            with self._lock:
                self.proxied += 1
                self.proxy_authorizations.append(lower.get("proxy-authorization", ""))
            headers = [(k, v) for k, v in headers if not k.lower().startswith("proxy-")]
            if method == "CONNECT":
                self._tunnel(client, lower.get("proxy-authorization"))
                return
            parts = urlsplit(path)
            path = parts.path + (f"?{parts.query}" if parts.query else "")
        body = reader.read(int(lower.get("content-length", "0") or 0))
        fault = self._take(method, path, lower)
        fault, _, wait = (fault or "").partition("+")
        if fault in _ERRORS:
            status, reason, code, message = _ERRORS[fault]
            xml = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message></Error>"
            ).encode()
            asked = f"Retry-After: {wait}\r\n" if wait else ""
            client.sendall(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n{asked}"
                f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode()
                + xml
            )
            return
        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in ("connection", "keep-alive"):
                    upstream.putheader(name, value)
            upstream.putheader("Connection", "close")
            upstream.endheaders(body if body else None)
            response = upstream.getresponse()
            payload = response.read()
            status_line = f"HTTP/1.1 {response.status} {response.reason}\r\n"
            out_headers = [
                (k, v)
                for k, v in response.getheaders()
                if k.lower() not in ("connection", "transfer-encoding", "content-length")
            ]
        finally:
            upstream.close()
        head = status_line + "".join(f"{k}: {v}\r\n" for k, v in out_headers)
        head += f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        if not fault or len(payload) < 2:
            client.sendall(head.encode("latin-1") + payload)
            return
        client.sendall(head.encode("latin-1") + payload[: len(payload) // 2])
        if fault == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif fault == "stall":
            self._stop.wait(self.stall_seconds)
        # "short": a clean close with the body half sent

    def _tunnel(self, client: socket.socket, authorization: str | None) -> None:
        if self.require_authorization is not None and authorization != self.require_authorization:
            client.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
            return
        upstream = socket.create_connection(self.upstream, timeout=60)
        try:
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            relay(client, upstream, self._stop)
        finally:
            upstream.close()

"""Where a request goes: the target a signed URL names, the proxy the environment names for it,
and the ``CONNECT`` tunnel through that proxy."""

from __future__ import annotations

import asyncio
import base64
import socket
import urllib.request
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

_CONNECT_REPLY_LIMIT = 64 * 1024


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
        """The proxy the environment names for ``target`` (``NO_PROXY`` included), by the rule of
        ``urllib.request`` that botocore and requests follow too."""
        url = None if _bypassed(target) else urllib.request.getproxies().get(target.scheme)
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


def _bypassed(target: Target) -> bool:
    try:
        return bool(urllib.request.proxy_bypass(target.netloc))
    except (TypeError, OSError):  # an unresolvable host: not bypassed, as botocore decides
        return False


class UnsupportedProxy(ValueError):
    """The environment names a proxy this client cannot use (not ``http://``)."""


class ProxyError(ConnectionError):
    """The proxy answered a ``CONNECT`` with something other than success."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(f"the proxy refused the tunnel: {line}")
        self.status = status


async def tunnel(proxy: Proxy, target: Target) -> socket.socket:
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
            if len(reply) > _CONNECT_REPLY_LIMIT:
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

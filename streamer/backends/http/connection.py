"""A keep-alive HTTP/1.1 connection that sends GETs (ranged into destination memory, or the
control plane's) and hands each response to ``Response``."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Mapping

from streamer.backends.http.endpoint import Proxy, Target, tunnel
from streamer.backends.http.response import Response, Verify
from streamer.backends.http.timing import LowSpeed, bounded


class Connection:
    """A keep-alive HTTP/1.1 connection to one endpoint, reopened when it breaks."""

    def __init__(
        self,
        ssl_context: Callable[[], ssl.SSLContext],
        proxy_for: Callable[[Target], Proxy | None],
        connect_timeout: float,
        read_timeout: float,
    ) -> None:
        self._ssl = ssl_context
        self._proxy_for = proxy_for
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._where: tuple[str, str, int] | None = None
        self._protocol: Response | None = None
        self._proxy: Proxy | None = None  # the proxy of the open connection
        self.received = 0  # body bytes the last request wrote
        self.status = 0  # the last request's status
        self.headers: dict[str, str] = {}  # response headers of the last request

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
        end = begin + len(dst) - 1
        await self._exchange(
            target,
            {"Range": f"bytes={begin}-{end}", **headers},
            lambda protocol: protocol.start(dst, begin, size, verify, speed),
        )

    async def request(
        self, target: Target, headers: Mapping[str, str], dst: memoryview, *, speed: LowSpeed | None = None
    ) -> tuple[int, bytes]:
        """A control-plane GET (a header read, a listing page): its status and at most ``len(dst)``
        body bytes, received into ``dst`` (a body that fills it may be longer); ``headers`` then
        holds the answer's headers."""
        await self._exchange(target, headers, lambda protocol: protocol.start_plain(dst, speed))
        return self.status, bytes(dst[: self.received])

    async def _exchange(
        self,
        target: Target,
        headers: Mapping[str, str],
        start: Callable[[Response], asyncio.Future[None]],
    ) -> None:
        """Sends one GET and waits for its answer, as ``start`` set the protocol up to take it."""
        self.received = 0
        self.status = 0
        self.headers = {}
        protocol = await self._open(target)
        assert protocol.transport is not None
        forwarder = self._proxy if target.scheme == "http" else None  # tunnels carry origin form
        lines = [
            f"GET {target.url if forwarder else target.target} HTTP/1.1",
            f"Host: {target.netloc}",
            "Accept-Encoding: identity",
            "User-Agent: streamer",
        ]
        if forwarder is not None and forwarder.authorization:
            lines.append(f"Proxy-Authorization: {forwarder.authorization}")
        lines += [f"{name}: {value}" for name, value in headers.items()]
        done = start(protocol)
        protocol.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        try:
            await self._wait(protocol, done)
        except BaseException:
            self.received = protocol.received if protocol.trusted else 0
            self.close()  # a half-read response leaves the connection out of step
            _settle(done)
            raise
        self.received = protocol.received
        self.status = protocol.status
        self.headers = protocol.headers
        if not protocol.keep_alive:
            self.close()

    async def _wait(self, protocol: Response, done: asyncio.Future[None]) -> None:
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

    async def _open(self, target: Target) -> Response:
        where = (target.scheme, target.host, target.port)
        protocol = self._protocol
        if protocol is not None and (protocol.closed or where != self._where):
            self.close()
            protocol = None
        if protocol is None:
            proxy = self._proxy_for(target)
            protocol = await bounded(self._connect(target, proxy), self._connect_timeout, discard=_abort)
            self._protocol, self._where, self._proxy = protocol, where, proxy
        assert protocol is not None
        return protocol

    async def _connect(self, target: Target, proxy: Proxy | None) -> Response:
        loop = asyncio.get_running_loop()
        use_ssl = self._ssl() if target.scheme == "https" else None  # loading CAs costs 0.1 s
        if proxy is None:
            hostname = target.host if use_ssl else None
            _, protocol = await loop.create_connection(
                Response, target.host, target.port, ssl=use_ssl, server_hostname=hostname
            )
        elif use_ssl is None:
            _, protocol = await loop.create_connection(Response, proxy.host, proxy.port)
        else:
            socket = await tunnel(proxy, target)
            try:
                _, protocol = await loop.create_connection(
                    Response, sock=socket, ssl=use_ssl, server_hostname=target.host
                )
            except BaseException:
                socket.close()
                raise
        return protocol

    def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abort()  # no lingering FIN_WAIT; nothing more is sent anyway


def _abort(protocol: Response) -> None:
    """Closes a connection nobody will use."""
    if protocol.transport is not None:
        protocol.transport.abort()


def _settle(done: asyncio.Future[None]) -> None:
    """Ends a request's future that nobody will await: no "exception was never retrieved"."""
    if not done.done():
        done.cancel()
    elif not done.cancelled():
        done.exception()


def ssl_context(ca_bundle: str | None, verify: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_bundle if verify else None)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context

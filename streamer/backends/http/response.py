"""One HTTP/1.1 response, parsed as it arrives, its body received straight into destination
memory: the status line and headers, the checks a success must pass before a body byte lands,
chunked framing, and an error's body. A control-plane request (a header read, a listing page)
takes any status and keeps at most a bound of its body. No sockets are opened here
(``connection.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Mapping

from streamer.backends.http.timing import LowSpeed

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


def xml_error_code(body: bytes) -> str | None:
    """The ``<Code>`` of an XML error body (S3's, Azure's), if it has one."""
    match = _CODE.search(body)
    return match.group(1).decode("ascii", "replace") if match else None


def xml_error_fields(body: bytes) -> dict[str, str]:
    """The ``<Endpoint>`` and ``<Region>`` of an XML error body (S3's hints to a bucket elsewhere)."""
    fields = {}
    for name in ("Endpoint", "Region"):
        found = re.search(rb"<" + name.encode() + rb">([^<]{1,256})</" + name.encode() + rb">", body)
        if found:
            fields[name] = found.group(1).decode("ascii", "replace")
    return fields


class Response(asyncio.BufferedProtocol):
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
        self._want = 0  # body bytes expected: the range asked for, or a plain answer's framing
        self._plain = False  # a control-plane request: any status, body kept up to len(dst)
        self._until_close = False  # a plain body without framing: it ends with the connection
        self._cut = False  # a plain chunked body longer than dst: it ends where dst does
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
        """A ranged GET of ``len(dst)`` bytes from ``begin`` of a ``size``-byte object."""
        self._dst, self._begin, self._size, self._verify = dst, begin, size, verify
        self._want, self._plain = len(dst), False
        return self._start(speed)

    def start_plain(self, dst: memoryview, speed: LowSpeed | None) -> asyncio.Future[None]:
        """A control-plane GET: any final status, its body written into ``dst`` as far as it goes
        (a body that fills ``dst`` is cut there, and the connection closed after it)."""
        self._dst, self._begin, self._size, self._verify = dst, 0, 0, None
        self._want, self._plain = len(dst), True
        return self._start(speed)

    def _start(self, speed: LowSpeed | None) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        self._speed = speed
        self._until_close = self._cut = False
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
                return self._dst[self.received : self._want]  # the body: straight into place
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
                    self._chunk_ended()
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
        if self._plain:
            self._accept_plain(status, headers)
        elif status in (200, 206):
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

    def _accept_plain(self, status: int, headers: Mapping[str, str]) -> None:
        """Sets up a plain answer's body framing: chunked, a length, or until the close; a body
        longer than the destination is cut at its end (the caller sees a full destination)."""
        self.trusted = True
        transfer = headers.get("transfer-encoding")
        length = content_length(headers)
        if status in (204, 304):
            self._finish()
        elif transfer is not None:
            if transfer.strip().lower() != "chunked":
                raise ProtocolViolation(f"an unsupported Transfer-Encoding: {transfer[:40]!r}")
            if length is not None:
                raise ProtocolViolation("both Transfer-Encoding and Content-Length")
            self._state = _CHUNK_SIZE
        elif length is not None:
            if length > self._want:
                self.keep_alive = False  # the rest is never read
            self._want = min(length, self._want)
            self._state = _BODY
            if self._want == 0:
                self._finish()
        else:
            self._until_close, self.keep_alive = True, False
            self._state = _BODY

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
                self._chunk_ended()
            return self._running()
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
                if self._plain:
                    self._want = self.received
                elif self.received != self._want:
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
            if not self._plain:
                raise ProtocolViolation("a chunked body longer than the range asked for")
            self._cut, self.keep_alive = True, False  # kept up to the bound, then cut
            self._chunk_left, self._state = self._want - self.received, _CHUNK_DATA
        else:
            self._chunk_left, self._state = size, _CHUNK_DATA
        return True

    def _chunk_ended(self) -> None:
        if self._cut:
            self._finish()
        else:
            self._state = _CHUNK_END

    def _collect_error(self) -> None:
        body = self._pending
        if len(body) > _ERROR_BODY_LIMIT:
            self.keep_alive = False
            self._finish_error()
        elif 0 <= self._error_length <= len(body) or body.endswith(b"0\r\n\r\n"):
            self._finish_error()

    def _finish_error(self) -> None:
        body = bytes(self._pending)
        self._fail(HttpFailure(self.status, xml_error_code(body), self.headers, xml_error_fields(body)))

    def _finish(self) -> None:
        if self._running():
            assert self._done is not None
            self._done.set_result(None)

    def _lost(self, exc: Exception) -> None:
        if not self._running():
            return
        if self._state == _ERROR:
            self._finish_error()  # an error body that ran until the close
        elif self._state == _BODY and (self.received >= self._want or self._until_close):
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

"""A misbehaving S3 server on 127.0.0.1, on raw sockets so that it can break HTTP on purpose.

It serves objects path-style (``GET /bucket/key`` with ``Range``, ``If-Match`` honoured unless told
otherwise) and ``ListObjectsV2`` (``GET /bucket?list-type=2``), accepting any signature. Each
request is classified (``list``; ``header``: the header reads, from byte 0; ``data``: the
ranged GETs of the rest) and logged; ``plan`` picks a fault for it, or ``None`` for the
right answer. A fault writes whatever it likes to the socket and says whether the connection
stays open.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from s3_faults import LoopbackServer

Headers = list[tuple[str, str]]


@dataclass(frozen=True)
class Request:
    number: int  # 0, 1, ... in arrival order
    kind: str  # "list", "header" or "data"
    path: str  # the object "bucket/key", or the bucket for a listing
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    first: int  # the Range asked for, [first, last]; (0, -1) without one
    last: int


@dataclass
class Version:
    data: bytes
    etag: str

    @classmethod
    def of(cls, data: bytes) -> Version:
        return cls(data, '"' + hashlib.md5(data).hexdigest() + '"')


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Headers
    body: bytes

    def head(self, reason: str = "X") -> bytes:
        lines = [f"HTTP/1.1 {self.status} {reason}"] + [f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def replace(self, name: str, value: str | None) -> Answer:
        """The answer with header ``name`` set to ``value`` (``None``: removed)."""
        headers = [(k, v) for k, v in self.headers if k.lower() != name.lower()]
        if value is not None:
            headers.append((name, value))
        return Answer(self.status, headers, self.body)


# A fault: (server, request, socket) -> whether the connection may serve another request.
Fault = Callable[["HostileS3", Request, socket.socket], bool]
Plan = Callable[[Request], Fault | None]

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass
class HostileS3:
    objects: dict[str, Version]  # "bucket/key" -> what it holds now
    plan: Plan = lambda request: None
    honour_if_match: bool = True
    log: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: set[socket.socket] = set()
        self.stop = threading.Event()
        self._server = LoopbackServer(self._handle, "hostile-s3")

    @property
    def address(self) -> tuple[str, int]:
        return self._server.address

    @property
    def endpoint_url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def close(self) -> None:
        """Stops serving; connections the client left open are shut so no handler waits on them."""
        self.stop.set()
        with self._lock:
            for client in self._clients:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
        self._server.close()

    def requests(self, kind: str) -> list[Request]:
        with self._lock:
            return [r for r in self.log if r.kind == kind]

    # --- right answers --------------------------------------------------------------------------

    def answer(self, request: Request, version: Version | None = None) -> Answer:
        """What a correct S3 server answers (``version``: as if the object held that)."""
        if request.kind == "list":
            return self.listing(request, truncated_with=None)
        current = self.objects.get(request.path)
        if current is None:
            return error(404, "NoSuchKey")
        version = version or current
        wanted = request.headers.get("if-match")
        if self.honour_if_match and wanted is not None and wanted != version.etag:
            return error(412, "PreconditionFailed")
        size = len(version.data)
        headers: Headers = [("ETag", version.etag), ("Last-Modified", "Mon, 23 Nov 2026 10:00:00 GMT")]
        if "range" not in request.headers:
            return Answer(200, [*headers, ("Content-Length", str(size))], version.data)
        first, last = request.first, min(request.last, size - 1)
        if first >= size:
            return error(416, "InvalidRange")
        body = version.data[first : last + 1]
        headers += [("Content-Range", f"bytes {first}-{last}/{size}"), ("Content-Length", str(len(body)))]
        return Answer(206, headers, body)

    def listing(self, request: Request, *, truncated_with: str | None) -> Answer:
        """ListObjectsV2, one page; ``truncated_with``: claim more pages behind that token."""
        prefix = request.query.get("prefix", "")
        keys = sorted(
            path.split("/", 1)[1]
            for path in self.objects
            if path.startswith(request.path + "/" + prefix)
            and "/" not in path.split("/", 1)[1][len(prefix) :]
        )
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><Size>{len(self.objects[request.path + '/' + k].data)}</Size>"
            f"<ETag>{escape(self.objects[request.path + '/' + k].etag)}</ETag></Contents>"
            for k in keys
        )
        more = (
            f"<IsTruncated>true</IsTruncated><NextContinuationToken>{truncated_with}</NextContinuationToken>"
            if truncated_with
            else "<IsTruncated>false</IsTruncated>"
        )
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(request.path)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(keys)}</KeyCount>"
            f"<MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter>{more}{contents}</ListBucketResult>"
        ).encode()
        return Answer(200, [("Content-Type", "application/xml"), ("Content-Length", str(len(xml)))], xml)

    # --- the connection loop -------------------------------------------------------------------

    def _handle(self, client: socket.socket) -> None:
        with self._lock:
            self._clients.add(client)
        reader = client.makefile("rb")
        try:
            while not self.stop.is_set():
                request = self._read(reader)
                if request is None:
                    return
                fault = self.plan(request)
                if fault is not None:
                    if not fault(self, request, client):
                        return
                    continue
                answer = self.answer(request)
                client.sendall(answer.head() + answer.body)
        except OSError:
            return
        finally:
            with self._lock:
                self._clients.discard(client)
            reader.close()
            client.close()

    def _read(self, reader: object) -> Request | None:
        readline = reader.readline  # type: ignore[attr-defined]
        line = readline().decode("latin-1").rstrip("\r\n")
        if not line:
            return None
        _, target, _ = line.split(" ", 2)
        headers: dict[str, str] = {}
        while True:
            text = readline().decode("latin-1").rstrip("\r\n")
            if not text:
                break
            name, _, value = text.partition(":")
            headers[name.strip().lower()] = value.strip()
        parts = urlsplit(target)
        path = unquote(parts.path).lstrip("/")
        query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        match = _RANGE.fullmatch(headers.get("range", ""))
        first, last = (int(match.group(1)), int(match.group(2) or 1 << 62)) if match else (0, -1)
        if "list-type" in query:
            kind = "list"
        elif match and first > 0:  # a header read starts at 0; data never does (the header is there)
            kind = "data"
        else:
            kind = "header"
        with self._lock:
            request = Request(len(self.log), kind, path, query, headers, first, last)
            self.log.append(request)
        return request


def error(status: int, code: str, extra: str = "", headers: Headers | None = None) -> Answer:
    xml = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>{extra}</Error>'.encode()
    return Answer(
        status,
        [("Content-Type", "application/xml"), ("Content-Length", str(len(xml))), *(headers or [])],
        xml,
    )


def reset(client: socket.socket) -> None:
    """Closes with a TCP reset rather than a FIN."""
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def wait_for_hangup(server: HostileS3, client: socket.socket, seconds: float) -> None:
    """Silence until the client hangs up, the server stops, or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not server.stop.is_set() and time.monotonic() < deadline:
        readable, _, _ = select.select([client], [], [], 0.05)
        if readable and not client.recv(4096, socket.MSG_PEEK):
            return

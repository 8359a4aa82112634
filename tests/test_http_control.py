"""The control plane's GETs (header reads, listings, small objects) on the project's own HTTP
client: any status, every body framing, a bound on what is kept, and the connection reused only
when the answer ended cleanly. A raw server on 127.0.0.1 writes each answer byte for byte."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from streamer.backends.http.connection import Connection
from streamer.backends.http.endpoint import Target
from streamer.backends.http.timing import LowSpeed


def head(status: str, *headers: str) -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *headers]) + "\r\n\r\n").encode()


async def exchange(
    answers: list[bytes], limit: int, requests: int = 1
) -> list[tuple[int, dict[str, str], bytes] | BaseException]:
    """Sends ``requests`` GETs on one ``Connection`` to a server that writes ``answers`` in turn
    (one per request; a server connection closes after its last one); each result or failure."""
    connections = 0
    queue = list(answers)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while queue:
                await reader.readuntil(b"\r\n\r\n")
                answer = queue.pop(0)
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer or not queue:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = Connection(ssl.create_default_context, lambda target: None, 5.0, 5.0)
    results: list[tuple[int, dict[str, str], bytes] | BaseException] = []
    try:
        for _ in range(requests):
            try:
                status, body = await connection.request(
                    Target.parse(f"http://127.0.0.1:{port}/b/k"),
                    {},
                    memoryview(bytearray(limit + 1)),
                    speed=LowSpeed(1, 10.0),
                )
                results.append((status, dict(connection.headers), body))
            except Exception as exc:
                results.append(exc)
    finally:
        connection.close()
        server.close()
        await server.wait_closed()
    results.append(RuntimeError(f"{connections} connection(s)"))
    return results


def run(answers: list[bytes], limit: int = 100, requests: int = 1) -> list[object]:
    return asyncio.run(exchange(answers, limit, requests))


def test_a_length_framed_answer_keeps_the_connection() -> None:
    answer = head("200 OK", "Content-Length: 5", 'ETag: "e"') + b"hello"
    *got, connections = run([answer, answer], requests=2)
    assert got == [(200, {"content-length": "5", "etag": '"e"'}, b"hello")] * 2
    assert str(connections) == "1 connection(s)"


def test_chunked_interim_and_error_answers() -> None:
    chunked = (
        head("206 Partial", "Transfer-Encoding: chunked")
        + b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-T: 1\r\n\r\n"
    )
    interim = head("100 Continue") + head("200 OK", "Content-Length: 2") + b"ok"
    xml = b"<Error><Code>NoSuchKey</Code></Error>"
    error = head("404 Not Found", f"Content-Length: {len(xml)}") + xml
    *got, connections = run([chunked, interim, error], requests=3)
    assert [(g[0], g[2]) for g in got if isinstance(g, tuple)] == [
        (206, b"abcde"),
        (200, b"ok"),
        (404, xml),
    ]
    assert str(connections) == "1 connection(s)"


def test_no_body_and_a_body_until_the_close() -> None:
    empty = head("204 No Content")
    until_close = head("200 OK") + b"all of it"
    *got, connections = run([empty, until_close], requests=3)
    assert got[0] == (204, {}, b"")
    assert got[1] == (200, {}, b"all of it")
    assert isinstance(got[2], OSError)  # the server is gone: nothing left to answer
    assert str(connections) in ("1 connection(s)", "2 connection(s)")


@pytest.mark.parametrize(
    "answer",
    [
        head("200 OK", "Content-Length: 500") + b"x" * 500,
        head("200 OK", "Transfer-Encoding: chunked") + b"1f4\r\n" + b"x" * 500 + b"\r\n0\r\n\r\n",
        head("200 OK") + b"x" * 500,
    ],
    ids=["length", "chunked", "until-close"],
)
def test_a_body_over_the_bound_is_cut_and_the_connection_not_reused(answer: bytes) -> None:
    ok = head("200 OK", "Content-Length: 2") + b"ok"
    *got, connections = run([answer, ok], limit=100, requests=2)
    assert got[0] == (200, got[0][1], b"x" * 101)  # type: ignore[index]
    assert got[1][2] == b"ok"  # type: ignore[index]  # on a new connection
    assert str(connections) == "2 connection(s)"


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (head("200 OK", "Content-Length: 10") + b"short", ConnectionResetError),
        (head("200 OK", "Transfer-Encoding: chunked") + b"zz\r\n", Exception),
        (head("200 OK", "Transfer-Encoding: gzip") + b"x", Exception),
        (head("200 OK", "Content-Length: 1, 2") + b"x", Exception),
        (b"SSH-2.0-OpenSSH\r\n\r\n", Exception),
    ],
    ids=["cut", "bad-chunk", "transfer-gzip", "length-conflict", "not-http"],
)
def test_a_broken_answer_fails(answer: bytes, error: type[BaseException]) -> None:
    got, _ = run([answer])
    assert isinstance(got, error), got

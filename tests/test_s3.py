"""S3 sources against a real S3 server on 127.0.0.1 (moto), with a fault-injecting proxy in front.

Every source form (one object, a prefix, an index, a list of objects) and every API (load,
load_file, open, get_tensor, load_into, the staged ring) must be bit-exact with ``safetensors``;
throttling, 5xx, resets, stalls and short bodies are retried for the missing bytes and counted;
persistent faults, denied or missing objects and objects replaced mid-load fail with a typed
error that names the object, and nothing (threads, descriptors, sockets) is left behind.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import gc
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import safetensors.torch
import torch
from conftest import (
    TORCH_DTYPE,
    KiB,
    Written,
    assert_same_dict,
    checkpoint_order,
    fd_count,
    loopback_s3_config,
    open_files,
    random_tensor,
    reference_load,
    s3_client,
    thread_count,
    write_checkpoint,
)
from copy_standin import StandIn
from s3_faults import FaultProxy, any_get
from tls_relay import TlsRelay

import streamer
from streamer import S3Config, S3Error, S3SourceError, SourceError, StreamerConfig
from streamer.backends.http import client as http_client
from streamer.backends.http import endpoint as http_endpoint
from streamer.backends.http.endpoint import Proxy, ProxyError, Target, UnsupportedProxy
from streamer.backends.http.storage import index_set
from streamer.backends.s3.uri import S3Uri
from streamer.host.collector import CollectorHold

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

BUCKET = "models"
ACCESS_KEY = "AKIDTESTSENTINEL42"
SECRET_KEY = "secret/SENTINEL+value/0123456789"
TOKEN = "session-token-SENTINEL-77"


# --- server, proxy and data ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(s3_server: str) -> Any:
    client = s3_client(s3_server, ACCESS_KEY, SECRET_KEY)
    client.create_bucket(Bucket=BUCKET)
    return client


def upload(s3: Any, written: Written, prefix: str) -> None:
    for shard in written.shards:
        s3.upload_file(str(shard), BUCKET, f"{prefix}/{shard.name}")
    if written.index is not None:
        s3.upload_file(str(written.index), BUCKET, f"{prefix}/{written.index.name}")


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory: pytest.TempPathFactory, s3: Any) -> Written:
    """Every dtype the local tests cover, 0-d to multi-block, in two shards with an index."""
    g = torch.Generator().manual_seed(41)
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, dtype) in enumerate(TORCH_DTYPE.items()):
        tensors[f"{name}.big"] = random_tensor((23 * KiB + 7 * i,), dtype, g)
        tensors[f"{name}.small"] = random_tensor((3, 5 + i), dtype, g)
        tensors[f"{name}.scalar"] = random_tensor((), dtype, g)
        tensors[f"{name}.empty"] = random_tensor((0, 3), dtype, g)
    tensors["huge"] = random_tensor((200 * KiB,), torch.float32, g)  # 800 KiB: many blocks
    written = write_checkpoint(
        tmp_path_factory.mktemp("s3dtypes"), tensors, shards=2, metadata={"origin": "s3-test"}
    )
    upload(s3, written, "dtypes")
    return written


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, s3: Any) -> Written:
    g = torch.Generator().manual_seed(42)
    tensors = {f"w{i}": random_tensor((16 * KiB + i,), torch.bfloat16, g) for i in range(12)}
    written = write_checkpoint(tmp_path_factory.mktemp("s3single"), tensors, index=False)
    upload(s3, written, "single")
    return written


@pytest.fixture
def proxy(s3_server: str) -> Iterator[FaultProxy]:
    host, port = s3_server.removeprefix("http://").split(":")
    p = FaultProxy((host, int(port)), stall_seconds=3.0)
    try:
        yield p
    finally:
        p.close()


def s3_config(endpoint: str, **overrides: Any) -> S3Config:
    return loopback_s3_config(endpoint, (ACCESS_KEY, SECRET_KEY, TOKEN), **overrides)


def cfg(endpoint: str, *, block_size: int = 64 * KiB, memory_limit: int | None = None, **s3: Any) -> Any:
    return StreamerConfig(
        concurrency=2, block_size=block_size, memory_limit=memory_limit, s3=s3_config(endpoint, **s3)
    )


# --- every source form, every API ---------------------------------------------------------------


@pytest.mark.parametrize("form", ["index", "prefix", "prefix-no-slash", "list"])
def test_every_source_form_is_bit_exact(s3_server: str, every_dtype: Written, form: str) -> None:
    source: Any = {
        "index": f"s3://{BUCKET}/dtypes/{every_dtype.index.name if every_dtype.index else ''}",
        "prefix": f"s3://{BUCKET}/dtypes/",
        "prefix-no-slash": f"s3://{BUCKET}/dtypes",
        "list": [f"s3://{BUCKET}/dtypes/{p.name}" for p in every_dtype.shards],
    }[form]
    got = streamer.load(source, config=cfg(s3_server))
    assert_same_dict(got, reference_load(every_dtype.shards))
    assert list(got) == checkpoint_order(every_dtype.shards)


def test_single_object_load_file_open_get_tensor(s3_server: str, single: Written) -> None:
    uri = f"s3://{BUCKET}/single/{single.shards[0].name}"
    expected = reference_load(single.shards)
    assert_same_dict(streamer.load_file(uri, config=cfg(s3_server)), expected)
    with streamer.open(uri, config=cfg(s3_server), order="checkpoint") as handle:
        assert handle.files == (uri,)
        assert handle.keys() == list(expected)
        streamed = dict(iter(handle))
        metrics = handle.metrics
        assert_same_dict({"w5": handle.get_tensor("w5")}, {"w5": expected["w5"]})
    assert_same_dict(streamed, expected)
    assert metrics["s3_files"] == 1 and metrics["retries"] == 0
    assert metrics["requests"] == metrics["blocks"] > 1  # one ranged GET per block
    assert metrics["bytes_read"] == single.nbytes


def test_fresh_buffers_are_faulted_in_ahead_of_s3_bytes_only(s3_server: str, single: Written) -> None:
    """One thread receives every S3 byte, so its fresh buffers are faulted in elsewhere first
    (never changing a byte); local files are read by many threads and are not."""
    expected = reference_load(single.shards)
    with streamer.open(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(s3_server)) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        assert handle.metrics["prefault_bytes"] >= handle.metrics["bytes_read"]
    with streamer.open(single.shards[0], config=cfg(s3_server)) as handle:
        assert_same_dict(dict(iter(handle)), expected)
        assert handle.metrics["prefault_bytes"] == 0


def test_prefault_stops_where_the_reads_end(tmp_path: Path, s3: Any, s3_server: str) -> None:
    """Under a memory limit, buffers take the largest segment's capacity (an idle one then fits
    any next segment): only the bytes that reads fill are faulted in ahead, not the capacity."""
    g = torch.Generator().manual_seed(7)
    sizes = {"a": 300 * KiB, "b": 40 * KiB, "c": 300 * KiB}  # three segments; b's buffer is mostly tail
    written = write_checkpoint(tmp_path, {n: random_tensor((k,), torch.uint8, g) for n, k in sizes.items()})
    upload(s3, written, "tails")
    config = cfg(s3_server, memory_limit=1280 * KiB)  # segments of up to 312 KiB: a, b, c alone
    with streamer.open(f"s3://{BUCKET}/tails/", config=config) as handle:
        held = dict(iter(handle))  # every buffer stays referenced: none is reused
        metrics = handle.metrics
    assert_same_dict(held, reference_load(written.shards))
    assert metrics["buffers_reused"] == 0
    read, page_ends = metrics["bytes_read"], metrics["blocks"] * 4096  # reads end on a page
    assert read <= metrics["prefault_bytes"] < read + page_ends


def test_open_streams_under_a_memory_limit(s3_server: str, every_dtype: Written) -> None:
    limit = 256 * KiB
    config = cfg(s3_server, memory_limit=limit)
    # "huge" is larger than the limit: a warning, then it is read alone
    with pytest.warns(RuntimeWarning), streamer.open(f"s3://{BUCKET}/dtypes/", config=config) as handle:
        streamed = {name: tensor.clone() for name, tensor in handle}
        metrics = handle.metrics
    assert_same_dict(streamed, reference_load(every_dtype.shards))
    assert metrics["peak_buffer_bytes"] <= 800 * KiB + limit + 8 * KiB


def test_metadata_and_long_header(s3_server: str, every_dtype: Written) -> None:
    """A header longer than the speculative first GET takes a second one."""
    with streamer.open(f"s3://{BUCKET}/dtypes/", config=cfg(s3_server, header_bytes=64)) as handle:
        assert handle.metadata() == {"origin": "s3-test"}
        got = dict(iter(handle))
    assert_same_dict(got, reference_load(every_dtype.shards))


def test_load_into_existing_tensors(s3_server: str, every_dtype: Written) -> None:
    expected = reference_load(every_dtype.shards)
    dest = {name: torch.zeros_like(t) for name, t in expected.items()}
    result = streamer.load_into(dest, f"s3://{BUCKET}/dtypes/", config=cfg(s3_server, memory_limit=128 * KiB))
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_same_dict(dest, expected)


def test_staged_ring_path(monkeypatch: pytest.MonkeyPatch, s3_server: str, every_dtype: Written) -> None:
    """The GPU path (ring slots, copies, slot reuse) with the CPU stand-in copy engine."""
    standin = StandIn(monkeypatch)
    got = streamer.load(
        f"s3://{BUCKET}/dtypes/", config=cfg(s3_server, block_size=16 * KiB, memory_limit=64 * KiB)
    )
    assert_same_dict(got, reference_load(every_dtype.shards))
    standin.assert_clean()


# --- source errors --------------------------------------------------------------------------------


def test_bad_uris_and_missing_things(s3_server: str, single: Written, tmp_path: Path) -> None:
    c = cfg(s3_server)
    for bad in ("s3://", "s3:///key.safetensors", "s3://bad bucket/x.safetensors"):
        with pytest.raises(SourceError, match="bad S3 URI"):
            streamer.load(bad, config=c)
    with pytest.raises(S3SourceError, match="no such bucket") as info:
        streamer.load("s3://no-such-bucket/x.safetensors", config=c)
    assert info.value.status == 404 and info.value.attempts == 1
    assert isinstance(info.value, FileNotFoundError)  # as a missing local file is
    with pytest.raises(S3SourceError, match="no such object") as info:
        streamer.load(f"s3://{BUCKET}/single/missing.safetensors", config=c)
    assert info.value.key == "single/missing.safetensors" and info.value.attempts == 1
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, streamer.S3MissingError)
    with pytest.raises(S3SourceError, match=r"no \*\.safetensors object"):
        streamer.load(f"s3://{BUCKET}/empty-prefix/", config=c)
    local = write_checkpoint(tmp_path, {"a": torch.ones(3)}, index=False).shards[0]
    with pytest.raises(SourceError, match="all local or all on S3"):
        streamer.load([str(local), f"s3://{BUCKET}/single/{single.shards[0].name}"], config=c)


def test_index_with_a_missing_shard(s3_server: str, s3: Any) -> None:
    s3.put_object(
        Bucket=BUCKET,
        Key="broken/model.safetensors.index.json",
        Body=b'{"weight_map": {"a": "model-00001-of-00002.safetensors"}}',
    )
    with pytest.raises(streamer.S3MissingError, match=r"references 1 missing shard\(s\): broken/model-00001"):
        streamer.load(f"s3://{BUCKET}/broken/model.safetensors.index.json", config=cfg(s3_server))


def test_a_prefix_with_an_index_reads_exactly_its_shards(s3_server: str, s3: Any, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    tensors = {f"w{i}": random_tensor((64,), torch.float32, g) for i in range(6)}
    written = write_checkpoint(tmp_path / "m", tensors, shards=3)
    stray = write_checkpoint(tmp_path / "m", tensors, index=False, prefix="consolidated")
    upload(s3, written, "indexed")
    s3.upload_file(str(stray.shards[0]), BUCKET, "indexed/consolidated.safetensors")
    for source in (f"s3://{BUCKET}/indexed/", f"s3://{BUCKET}/indexed"):
        with streamer.open(source, config=cfg(s3_server)) as handle:
            assert sorted(handle.files) == [f"s3://{BUCKET}/indexed/{p.name}" for p in written.shards]
            assert_same_dict(dict(handle), tensors)
    for shard in written.shards[1:]:  # an interrupted upload
        s3.delete_object(Bucket=BUCKET, Key=f"indexed/{shard.name}")
    with pytest.raises(streamer.S3MissingError) as info:
        streamer.load(f"s3://{BUCKET}/indexed/", config=cfg(s3_server))
    message = str(info.value)
    assert f"the index s3://{BUCKET}/indexed/model.safetensors.index.json references 2 missing" in message
    assert written.shards[1].name in message and written.shards[2].name in message
    assert written.shards[0].name not in message.partition("missing")[2]
    assert info.value.key == f"indexed/{written.shards[1].name}" and isinstance(info.value, FileNotFoundError)


def _uris(*keys: str) -> list[S3Uri]:
    return [S3Uri("b", key) for key in keys]


@pytest.mark.parametrize(
    ("listed", "early"),
    [
        (["m/model-00001-of-00002.safetensors", "m/model-00002-of-00002.safetensors"], [0, 1]),
        (["m/consolidated.safetensors", "m/model-00001-of-00001.safetensors"], [1]),  # a stray: never read
        (["m/model-00001-of-00002.safetensors"], []),  # incomplete: which other shards is unknown
        (["m/model-00001-of-00002.safetensors", "m/model-00002-of-00003.safetensors"], []),  # two sets
        (["m/model-00001-of-00002.safetensors", "m/model-2-of-2.safetensors"], []),  # spelt two ways
        (["m/model-1-of-2.safetensors", "m/model-01-of-2.safetensors", "m/model-2-of-2.safetensors"], []),
        (["m/other-00001-of-00001.safetensors"], []),  # another stem than the index's
        (["m/model-00000-of-00001.safetensors"], []),
        (["m/model-00001-of-99999999999999999999.safetensors"], []),  # a listing cannot make it count
    ],
)
def test_only_a_complete_set_of_the_index_s_shard_names_is_read_early(
    listed: list[str], early: list[int]
) -> None:
    uris = _uris(*listed)
    index = S3Uri("b", "m/model.safetensors.index.json")
    assert index_set(index, uris) == [uris[i] for i in early]


def _two_of_three_named(
    s3: Any, tmp_path: Path, prefix: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Three shards named as a complete set under ``prefix``, and an index naming the first two:
    every tensor, and the index's weight map."""
    g = torch.Generator().manual_seed(8)
    tensors = {f"w{i}": random_tensor((64 * KiB,), torch.float32, g) for i in range(6)}
    written = write_checkpoint(tmp_path / prefix, tensors, shards=3)
    index = json.loads(written.index.read_text()) if written.index else {}
    named = {
        name: shard for name, shard in index["weight_map"].items() if not shard.startswith("model-00003")
    }
    upload(s3, written, prefix)
    s3.put_object(
        Bucket=BUCKET, Key=f"{prefix}/model.safetensors.index.json", Body=json.dumps({"weight_map": named})
    )
    return tensors, named


def test_shard_fronts_read_early_that_the_index_does_not_name_are_dropped(
    proxy: FaultProxy, s3: Any, tmp_path: Path, no_leaks: None
) -> None:
    """The listing shows a complete set of three shards but the index names two: the third (denied)
    is asked for while the index is read, and its refusal is not the load's; the stray
    ``consolidated.safetensors`` is never asked for."""
    tensors, named = _two_of_three_named(s3, tmp_path, "partly")
    s3.put_object(Bucket=BUCKET, Key="partly/consolidated.safetensors", Body=b"not read")
    asked: list[str] = []

    def third_or_stray(method: str, path: str, headers: Any) -> bool:
        asked.append(path)
        return "model-00003" in path or "consolidated" in path

    proxy.inject("403", times=None, match=third_or_stray)
    loaded = streamer.load(f"s3://{BUCKET}/partly/", config=cfg(proxy.endpoint_url))
    assert_same_dict(loaded, {name: tensors[name] for name in named})
    assert any("model-00003" in path for path in asked)  # read early, while the index was
    assert not any("consolidated" in path for path in asked)


def test_an_early_shard_front_that_stalls_is_cancelled_not_waited_for(
    proxy: FaultProxy, s3: Any, tmp_path: Path
) -> None:
    """The unnamed shard's early read gets its headers and then silence: the open does not wait
    for it (it is cancelled once the index is read). (The proxy's own thread stays in the stall,
    so the leak check is the test above's, where the early read is refused instead.)"""
    tensors, named = _two_of_three_named(s3, tmp_path, "stalling")
    proxy.stall_seconds = 60.0
    proxy.inject("stall", times=None, match=lambda method, path, headers: "model-00003" in path)
    started = time.monotonic()
    loaded = streamer.load(f"s3://{BUCKET}/stalling/", config=cfg(proxy.endpoint_url))
    assert time.monotonic() - started < 30  # a hang check: the stall alone lasts 60 s
    assert_same_dict(loaded, {name: tensors[name] for name in named})
    assert proxy.injected >= 1


@pytest.mark.parametrize(
    "entry", ["../single/x.safetensors", "/single/x.safetensors", "a/../../x.safetensors"]
)
def test_an_index_entry_outside_its_prefix_is_refused(s3_server: str, s3: Any, entry: str) -> None:
    s3.put_object(
        Bucket=BUCKET,
        Key="escaping/model.safetensors.index.json",
        Body=json.dumps({"weight_map": {"a": entry}}).encode(),
    )
    for source in (f"s3://{BUCKET}/escaping/model.safetensors.index.json", f"s3://{BUCKET}/escaping/"):
        with pytest.raises(SourceError, match="outside the index's directory") as info:
            streamer.load(source, config=cfg(s3_server))
        assert info.value.path == f"s3://{BUCKET}/escaping/model.safetensors.index.json"
        assert info.value.tensor == "a"


def test_an_index_object_over_the_limit_is_refused_from_its_size(
    s3_server: str, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streamer.backends.http.storage, "MAX_INDEX_BYTES", 1000)
    s3.put_object(Bucket=BUCKET, Key="huge/model.safetensors.index.json", Body=b" " * 5000)
    with pytest.raises(S3SourceError, match="more than the limit of 1000") as info:
        streamer.load(f"s3://{BUCKET}/huge/model.safetensors.index.json", config=cfg(s3_server))
    assert info.value.key == "huge/model.safetensors.index.json"


def test_not_a_safetensors_object(s3_server: str, s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key="junk/x.safetensors", Body=b"\xff" * 100)
    with pytest.raises(streamer.HeaderError, match=r"s3://models/junk/x\.safetensors"):
        streamer.load(f"s3://{BUCKET}/junk/x.safetensors", config=cfg(s3_server))
    s3.put_object(Bucket=BUCKET, Key="junk/empty.safetensors", Body=b"")
    with pytest.raises(streamer.HeaderError, match="too short"):
        streamer.load(f"s3://{BUCKET}/junk/empty.safetensors", config=cfg(s3_server))


# --- faults ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["503", "429", "500", "reset", "short", "stall"])
def test_transient_faults_are_retried(proxy: FaultProxy, single: Written, kind: str) -> None:
    proxy.inject(kind, times=3)
    uri = f"s3://{BUCKET}/single/{single.shards[0].name}"
    with streamer.open(uri, config=cfg(proxy.endpoint_url)) as handle:
        got = dict(iter(handle))
        metrics = handle.metrics
    assert_same_dict(got, reference_load(single.shards))
    assert proxy.injected == 3
    assert metrics["retries"] == 3, metrics
    assert metrics["throttles"] == (3 if kind in ("503", "429") else 0), metrics
    assert metrics["requests"] == metrics["blocks"] + 3


def test_faults_on_the_header_read_are_retried(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("503", times=2, match=any_get)
    got = streamer.load(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(proxy.endpoint_url))
    assert_same_dict(got, reference_load(single.shards))
    assert proxy.injected == 2


def settled_counts() -> tuple[int, int]:
    """Threads and descriptors once moto's handlers of the last connections are gone (5 s at most)."""
    counts, until = (thread_count(), fd_count()), time.monotonic() + 5
    while time.monotonic() < until:
        time.sleep(0.2)
        now = (thread_count(), fd_count())
        if now == counts:
            break
        counts = now
    return counts


@pytest.fixture
def no_leaks(single: Written, s3_server: str) -> Iterator[None]:
    """The process has the same threads and descriptors after the test as before (after a warm-up)."""
    streamer.load(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(s3_server))
    gc.collect()
    threads, fds = settled_counts()
    files = open_files()
    yield
    gc.collect()
    deadline = time.monotonic() + 5  # moto's own handler threads finish their last response
    while (thread_count(), fd_count()) != (threads, fds) and time.monotonic() < deadline:
        time.sleep(0.05)
    names = sorted(t.name for t in threading.enumerate())
    assert thread_count() == threads, f"threads leaked: {thread_count() - threads}; now {names}"
    assert fd_count() == fds, f"descriptors leaked: {sorted(set(open_files()) ^ set(files))}"
    assert not [t for t in threading.enumerate() if t.name == "streamer-s3"]


@pytest.mark.parametrize("kind", ["503", "reset", "stall"])
def test_persistent_faults_fail_typed_within_the_deadline(
    s3_server: str, single: Written, no_leaks: None, kind: str
) -> None:
    host, port = s3_server.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), stall_seconds=3.0)
    try:
        proxy.inject(kind, times=None)
        started = time.monotonic()
        with pytest.raises(S3Error) as info:
            streamer.load(
                f"s3://{BUCKET}/single/{single.shards[0].name}",
                config=cfg(proxy.endpoint_url, max_attempts=3),
            )
        elapsed = time.monotonic() - started
    finally:
        proxy.close()
    error = info.value
    assert not isinstance(error, SourceError)
    assert error.attempts == 3 and error.bucket == BUCKET and error.key == f"single/{single.shards[0].name}"
    assert error.byte_range is not None and error.byte_range[0] < error.byte_range[1]
    assert f"bytes {error.byte_range[0]}-" in str(error) and "3 attempts" in str(error)
    if kind == "503":
        assert error.status == 503 and error.code == "SlowDown" and "HTTP 503 SlowDown" in str(error)
    assert elapsed < 3 * 1.0 * 3 + 10  # three tries, each at most one read timeout (+ stall slack)


def test_retry_deadline_bounds_the_retries(s3_server: str, single: Written, no_leaks: None) -> None:
    host, port = s3_server.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)))
    try:
        proxy.inject("503", times=None)
        started = time.monotonic()
        with pytest.raises(S3Error, match="gave up after 1 s"):
            streamer.load(
                f"s3://{BUCKET}/single/{single.shards[0].name}",
                config=cfg(proxy.endpoint_url, max_attempts=1000, retry_deadline=1.0, backoff_base=0.05),
            )
        assert time.monotonic() - started < 5
    finally:
        proxy.close()


@pytest.mark.parametrize("kind", ["403", "404"])
def test_denied_or_missing_data_fails_at_once(proxy: FaultProxy, single: Written, kind: str) -> None:
    proxy.inject(kind, times=None)
    with pytest.raises(S3Error) as info:
        streamer.load(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(proxy.endpoint_url))
    assert info.value.attempts == 1 and info.value.status == int(kind)


def test_denied_at_open_is_a_source_error(proxy: FaultProxy, single: Written) -> None:
    proxy.inject("403", times=None, match=any_get)
    with pytest.raises(S3SourceError, match="access denied") as info:
        streamer.open(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(proxy.endpoint_url))
    assert info.value.attempts == 1 and info.value.status == 403
    assert proxy.injected == 1


def test_object_replaced_during_the_load_is_an_error(
    s3_server: str, s3: Any, tmp_path: Path, no_leaks: None
) -> None:
    g = torch.Generator().manual_seed(3)
    first = write_checkpoint(tmp_path / "a", {"x": random_tensor((64 * KiB,), torch.float32, g)}, index=False)
    second = write_checkpoint(
        tmp_path / "b", {"x": random_tensor((64 * KiB,), torch.float32, g)}, index=False
    )
    s3.upload_file(str(first.shards[0]), BUCKET, "replaced/model.safetensors")
    with streamer.open(f"s3://{BUCKET}/replaced/model.safetensors", config=cfg(s3_server)) as handle:
        s3.upload_file(str(second.shards[0]), BUCKET, "replaced/model.safetensors")  # same layout
        with pytest.raises(S3Error, match="changed during the load") as info:
            dict(iter(handle))
    assert info.value.attempts == 1


def test_early_exit_and_failure_leave_nothing_behind(
    s3_server: str, every_dtype: Written, no_leaks: None, proxy: FaultProxy
) -> None:
    """(no_leaks before proxy: its check runs after the proxy has joined its handler threads)"""
    with streamer.open(f"s3://{BUCKET}/dtypes/", config=cfg(s3_server)) as handle:
        for _ in handle:
            break
    proxy.inject("404", times=None)
    with pytest.raises(S3Error):
        streamer.load(f"s3://{BUCKET}/dtypes/", config=cfg(proxy.endpoint_url))


# --- proxies (HTTP_PROXY / NO_PROXY) ----------------------------------------------------------


def _proxy_environment(monkeypatch: pytest.MonkeyPatch, url: str | None, no_proxy: str | None) -> None:
    for name in ("http_proxy", "https_proxy", "no_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    if url is not None:
        monkeypatch.setenv("HTTP_PROXY", url)
    if no_proxy is not None:
        monkeypatch.setenv("NO_PROXY", no_proxy)


def test_data_and_headers_go_through_the_environment_proxy(
    s3_server: str, proxy: FaultProxy, single: Written, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like boto3, every request follows HTTP_PROXY (with its credentials), data GETs included."""
    host_port = proxy.endpoint_url.removeprefix("http://")
    _proxy_environment(monkeypatch, f"http://loader:p%40ss@{host_port}", None)
    uri = f"s3://{BUCKET}/single/{single.shards[0].name}"
    with streamer.open(uri, config=cfg(s3_server)) as handle:
        got = dict(iter(handle))
        blocks = handle.metrics["blocks"]
    assert_same_dict(got, reference_load(single.shards))
    assert blocks > 1
    assert proxy.proxied >= blocks + 1  # every data GET and the header read
    expected = "Basic " + base64.b64encode(b"loader:p@ss").decode()
    assert set(proxy.proxy_authorizations) == {expected}


def test_no_proxy_bypasses_the_proxy(
    s3_server: str, proxy: FaultProxy, single: Written, monkeypatch: pytest.MonkeyPatch
) -> None:
    _proxy_environment(monkeypatch, proxy.endpoint_url, "127.0.0.1")
    got = streamer.load(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(s3_server))
    assert_same_dict(got, reference_load(single.shards))
    assert proxy.requests == 0


def test_https_endpoint_through_a_connect_proxy(
    s3_server: str, single: Written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """HTTPS_PROXY with an https endpoint: CONNECT tunnels, TLS verified end to end (our CA)."""
    host, port = s3_server.removeprefix("http://").split(":")
    relay = TlsRelay((host, int(port)), tmp_path)
    proxy = FaultProxy(relay.address)
    try:
        _proxy_environment(monkeypatch, None, None)
        monkeypatch.setenv("HTTPS_PROXY", proxy.endpoint_url)
        config = cfg(relay.endpoint_url, ca_bundle=str(relay.ca_file))
        with streamer.open(f"s3://{BUCKET}/single/{single.shards[0].name}", config=config) as handle:
            got = dict(iter(handle))
        assert_same_dict(got, reference_load(single.shards))
        assert proxy.proxied >= 2  # the client's header read and at least one data connection
        assert proxy.requests == 0  # nothing but CONNECTs reached the proxy
    finally:
        proxy.close()
        relay.close()


def test_a_proxy_refusing_the_tunnel_fails_at_once(
    s3_server: str, single: Written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    host, port = s3_server.removeprefix("http://").split(":")
    relay = TlsRelay((host, int(port)), tmp_path)
    proxy = FaultProxy(relay.address, require_authorization="Basic c2VjcmV0")
    try:
        _proxy_environment(monkeypatch, None, None)
        monkeypatch.setenv("HTTPS_PROXY", proxy.endpoint_url)
        key = f"single/{single.shards[0].name}"
        config = cfg(relay.endpoint_url, ca_bundle=str(relay.ca_file))
        started = time.monotonic()
        with pytest.raises(SourceError) as caught:
            streamer.load(f"s3://{BUCKET}/{key}", config=config)
        assert time.monotonic() - started < 10, "a refused tunnel is not worth retrying"
        assert "407" in str(caught.value) and key in str(caught.value)
    finally:
        proxy.close()
        relay.close()


def test_connect_tunnel_reaches_the_server(s3_server: str, proxy: FaultProxy) -> None:
    """The CONNECT handshake that https endpoints use (TLS then runs over the returned socket)."""
    target = Target.parse(f"{s3_server}/")
    host, port = proxy.endpoint_url.removeprefix("http://").split(":")
    tunnel = asyncio.run(http_endpoint.tunnel(Proxy(host, int(port), None), target))
    try:
        tunnel.setblocking(True)
        tunnel.sendall(f"GET / HTTP/1.1\r\nHost: {target.netloc}\r\nConnection: close\r\n\r\n".encode())
        assert tunnel.recv(12).startswith(b"HTTP/1.1 ")  # the S3 server answered through the tunnel
    finally:
        tunnel.close()
    assert proxy.proxied == 1


def test_a_refused_tunnel_is_a_typed_error(s3_server: str, proxy: FaultProxy) -> None:
    proxy.require_authorization = "Basic c2VjcmV0"
    target = Target.parse(f"{s3_server}/")
    host, port = proxy.endpoint_url.removeprefix("http://").split(":")
    with pytest.raises(ProxyError, match="407") as caught:
        asyncio.run(http_endpoint.tunnel(Proxy(host, int(port), None), target))
    assert caught.value.status == 407
    assert asyncio.run(http_endpoint.tunnel(Proxy(host, int(port), "Basic c2VjcmV0"), target)).close() is None


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({"HTTP_PROXY": "http://proxy.internal:3128"}, Proxy("proxy.internal", 3128, None)),
        ({"HTTP_PROXY": "proxy.internal:3128"}, Proxy("proxy.internal", 3128, None)),
        ({"HTTP_PROXY": "http://u:p@proxy.internal"}, Proxy("proxy.internal", 80, "Basic dTpw")),
        ({"HTTP_PROXY": "http://proxy.internal:3128", "NO_PROXY": "s3.example.com"}, None),
        ({"HTTP_PROXY": "http://proxy.internal:3128", "NO_PROXY": ".example.com"}, None),
        ({"HTTPS_PROXY": "http://proxy.internal:3128"}, None),  # the target is http
        ({}, None),
    ],
)
def test_proxy_choice_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], expected: Proxy | None
) -> None:
    _proxy_environment(monkeypatch, None, None)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert Proxy.for_target(Target.parse("http://s3.example.com/models/w.safetensors?X-Amz=1")) == expected


def test_an_https_proxy_url_is_refused_with_a_clear_error(
    s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _proxy_environment(monkeypatch, None, None)
    monkeypatch.setenv("HTTP_PROXY", "https://127.0.0.1:9")
    with pytest.raises(UnsupportedProxy, match="only http:// proxies"):
        Proxy.for_target(Target.parse(f"{s3_server}/"))


# --- credentials --------------------------------------------------------------------------------


def test_credentials_never_leak(
    proxy: FaultProxy, single: Written, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    config = cfg(proxy.endpoint_url, max_attempts=2)
    texts = [repr(config), str(config), repr(config.s3)]
    uri = f"s3://{BUCKET}/single/{single.shards[0].name}"
    streamer.load(uri, config=config)
    for failing in ("503", "403"):
        proxy.clear()
        proxy.inject(failing, times=None, match=any_get)
        with pytest.raises(S3Error) as info:
            streamer.load(uri, config=config)
        texts += [str(info.value), repr(info.value), repr(info.value.__dict__)]
    captured = capsys.readouterr()
    texts += [caplog.text, captured.out, captured.err]
    assert "***" in repr(config.s3)
    for text in texts:
        assert SECRET_KEY not in text and TOKEN not in text
        assert ACCESS_KEY not in text


@pytest.mark.parametrize("found_in", ["environment", "profile"])
def test_credentials_found_by_the_chain_never_leak(
    proxy: FaultProxy,
    single: Written,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    found_in: str,
) -> None:
    """Credentials boto3's chain finds are never shown: the environment's (read without
    botocore) and a profile's (botocore's chain, its DEBUG logs masked)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    profile: str | None = None
    if found_in == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    else:
        profile = "streamer-test"
        shared = tmp_path / "credentials"
        shared.write_text(
            f"[{profile}]\naws_access_key_id = {ACCESS_KEY}\n"
            f"aws_secret_access_key = {SECRET_KEY}\naws_session_token = {TOKEN}\n"
        )
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    caplog.set_level(logging.DEBUG)
    chain = s3_config(
        proxy.endpoint_url, access_key_id=None, secret_access_key=None, session_token=None, profile=profile
    )
    config = StreamerConfig(concurrency=2, block_size=64 * KiB, s3=chain)
    uri = f"s3://{BUCKET}/single/{single.shards[0].name}"
    streamer.load(uri, config=config)
    proxy.inject("403", times=None, match=any_get)
    with pytest.raises(S3Error) as info:
        streamer.load(uri, config=config)
    captured = capsys.readouterr()
    assert ("botocore" in caplog.text) == (found_in == "profile")  # only the profile needs botocore
    for text in (caplog.text, captured.out, captured.err, str(info.value), repr(info.value.__dict__)):
        assert SECRET_KEY not in text and TOKEN not in text and ACCESS_KEY not in text


def test_config_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("STREAMER_S3_CONCURRENCY", "7")
    monkeypatch.setenv("STREAMER_S3_ADDRESSING_STYLE", "virtual")
    monkeypatch.setenv("STREAMER_S3_ANONYMOUS", "1")
    monkeypatch.setenv("STREAMER_S3_MAX_ATTEMPTS", "3")
    monkeypatch.setenv("STREAMER_S3_RETRY_DEADLINE", "9.5")
    c = S3Config()
    assert (c.endpoint_url, c.concurrency, c.addressing_style, c.anonymous) == (
        "http://127.0.0.1:1",
        7,
        "virtual",
        True,
    )
    assert (c.max_attempts, c.retry_deadline) == (3, 9.5)
    monkeypatch.setenv("STREAMER_S3_ADDRESSING_STYLE", "sideways")
    with pytest.raises(streamer.ConfigError):
        S3Config()
    with pytest.raises(streamer.ConfigError):
        S3Config(access_key_id="only-half")


def test_anonymous_access(s3_server: str, s3: Any, single: Written) -> None:
    """Unsigned requests to a public object: no credentials are looked up at all."""
    s3.upload_file(
        str(single.shards[0]), BUCKET, "public/model.safetensors", ExtraArgs={"ACL": "public-read"}
    )
    got = streamer.load(
        f"s3://{BUCKET}/public/model.safetensors",
        config=cfg(s3_server, anonymous=True, access_key_id=None, secret_access_key=None, session_token=None),
    )
    assert_same_dict(got, reference_load(single.shards))


def test_import_stays_lazy() -> None:
    import subprocess
    import sys

    code = "import streamer, sys; print('aiobotocore' in sys.modules or 'botocore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "False"


def test_environment_credentials_need_no_sdk(s3_server: str, single: Written) -> None:
    """With credentials in the environment an S3 load imports no SDK at all, and works where
    botocore (the [s3] extra, for boto3's wider chain) is not installed."""
    import subprocess
    import sys

    uri = f"s3://{BUCKET}/single/{single.shards[0].name}"
    code = (
        "import importlib.abc, json, sys\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('botocore', 'boto3', 'aiobotocore', 'aiohttp'):\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Absent())\n"
        "import streamer\n"
        f"got = streamer.load({uri!r})\n"
        "import hashlib, torch\n"
        "print(json.dumps({k: hashlib.sha256(v.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()\n"
        "                  for k, v in got.items()}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_ENDPOINT_URL": s3_server,
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    expected = reference_load(single.shards)
    digests = {
        k: hashlib.sha256(v.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in expected.items()
    }
    assert json.loads(out.stdout.strip().splitlines()[-1]) == digests


def test_safetensors_reference_matches_upload(s3: Any, single: Written, tmp_path: Path) -> None:
    """The uploaded bytes are the local file's (so the bit-exact tests compare the right thing)."""
    path = tmp_path / "down.safetensors"
    s3.download_file(BUCKET, f"single/{single.shards[0].name}", str(path))
    assert path.read_bytes() == single.shards[0].read_bytes()
    assert_same_dict(safetensors.torch.load_file(str(path)), single.tensors)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"profile": "no-such-profile-streamer-test"}, "ProfileNotFound"),
        ({"endpoint_url": "http://[::1"}, "Invalid IPv6 URL"),
    ],
)
def test_a_client_botocore_will_not_make_is_a_config_error(
    settings: dict[str, Any], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bad client settings are the user's to fix: a ConfigError naming the endpoint, nothing of
    botocore's on the exception chain, and the loop thread gone."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    before = set(threading.enumerate())  # a thread of an earlier test may still be ending
    with pytest.raises(streamer.ConfigError, match=says) as caught:
        streamer.open("s3://bucket/model.safetensors", config=StreamerConfig(s3=S3Config(**settings)))
    assert "S3 client for" in str(caught.value)
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert set(threading.enumerate()) - before == set()


def test_a_throttled_request_waits_as_long_as_the_server_asks(proxy: FaultProxy, single: Written) -> None:
    """A 503 with ``Retry-After: 1`` is retried no sooner than the server asked (the client's own
    backoff here is 10 ms); one asking for an hour, past the retry deadline, fails at once."""
    uri = f"s3://{BUCKET}/single/{single.shards[0].name}"
    quick = {"backoff_base": 0.01, "backoff_max": 0.01}
    proxy.inject("503+1", times=1)
    started = time.monotonic()
    with streamer.open(uri, config=cfg(proxy.endpoint_url, **quick)) as handle:
        got = dict(iter(handle))
        metrics = handle.metrics
    assert time.monotonic() - started >= 1.0
    assert_same_dict(got, reference_load(single.shards))
    assert metrics["retries"] == 1 and metrics["throttles"] == 1
    proxy.clear()
    proxy.inject("503+3600", times=None)
    started = time.monotonic()
    asked = r"gave up after 5 s \(the server asked to wait 3.6e\+03 s more\)"
    with pytest.raises(streamer.S3Error, match=asked):
        streamer.load(uri, config=cfg(proxy.endpoint_url, retry_deadline=5, **quick))
    assert time.monotonic() - started < 30


def test_retry_after_is_read_as_seconds_or_an_http_date_and_only_on_throttling() -> None:
    from email.utils import format_datetime

    from streamer.backends.http.client import retry_after
    from streamer.backends.http.response import HttpFailure

    in_ten = format_datetime(
        datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=10), usegmt=True
    )
    assert retry_after(HttpFailure(503, "SlowDown", {"Retry-After": "7"})) == 7.0
    assert 8 < (retry_after(HttpFailure(429, None, {"retry-after": in_ten})) or 0) <= 10
    assert retry_after(HttpFailure(503, None, {"Retry-After": "soon"})) is None
    assert retry_after(HttpFailure(503, None, {})) is None
    assert retry_after(HttpFailure(500, None, {"Retry-After": "7"})) is None  # not a throttle
    assert retry_after(OSError("reset")) is None


# --- garbage collection while a load starts -----------------------------------------------------


class _RecordedHold(CollectorHold):
    made: ClassVar[list[CollectorHold]] = []

    def __init__(self) -> None:
        super().__init__()
        _RecordedHold.made.append(self)


@pytest.fixture
def recorded_holds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CollectorHold]]:
    """The collector holds made meanwhile, with automatic collection on to begin with."""
    monkeypatch.setattr(http_client, "CollectorHold", _RecordedHold)
    _RecordedHold.made = []
    was = gc.isenabled()
    gc.enable()
    try:
        yield _RecordedHold.made
    finally:
        if not was:
            gc.disable()


def test_collection_is_held_off_from_the_open_until_the_run_ends(
    s3_server: str, single: Written, recorded_holds: list[CollectorHold]
) -> None:
    seen: list[bool] = []
    streamed = {}
    config = cfg(s3_server, block_size=16 * KiB)  # dozens of GETs: the first tensor comes early
    with streamer.open(f"s3://{BUCKET}/single/", config=config) as handle:
        seen.append(gc.isenabled())  # opened
        for name, tensor in handle:
            if not streamed:
                seen.append(gc.isenabled())  # a block has landed, the run goes on
            streamed[name] = tensor.clone()
        seen.append(gc.isenabled())  # the run ended
        again = handle.load_all()  # a later run of the handle: the open's hold is over
        seen.append(gc.isenabled())
    assert_same_dict(streamed, reference_load(single.shards))
    assert_same_dict(again, streamed)
    assert seen == [False, False, True, True]
    assert len(recorded_holds) == 1 and not recorded_holds[0].held


def test_a_handle_opened_and_not_read_holds_collection_off_for_a_bounded_time(
    s3_server: str, single: Written, recorded_holds: list[CollectorHold], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_client, "COLLECTOR_HOLD_SECONDS", 0.2)
    with streamer.open(f"s3://{BUCKET}/single/", config=cfg(s3_server)):
        deadline = time.monotonic() + 10.0
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gc.isenabled()


def test_failed_opens_and_loads_leave_collection_on(
    proxy: FaultProxy, single: Written, recorded_holds: list[CollectorHold]
) -> None:
    proxy.inject("403", times=None, match=any_get)
    with pytest.raises(S3SourceError):
        streamer.open(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(proxy.endpoint_url))
    assert gc.isenabled()
    proxy.inject("403", times=None)  # the data GETs too, once the header read has passed
    with pytest.raises(S3Error):
        streamer.load(f"s3://{BUCKET}/single/{single.shards[0].name}", config=cfg(proxy.endpoint_url))
    assert gc.isenabled()
    assert len(recorded_holds) == 2 and not any(hold.held for hold in recorded_holds)


def test_a_collector_the_application_turned_off_stays_off_after_a_load(
    s3_server: str, single: Written, recorded_holds: list[CollectorHold]
) -> None:
    gc.disable()
    streamer.load(f"s3://{BUCKET}/single/", config=cfg(s3_server))
    assert not gc.isenabled()


def test_the_proxy_is_looked_up_once_per_endpoint(
    s3_server: str, single: Written, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up: list[str] = []
    lookup = Proxy.for_target

    def counted(target: Target) -> Proxy | None:
        looked_up.append(target.netloc)
        return lookup(target)

    monkeypatch.setattr(Proxy, "for_target", staticmethod(counted))
    config = cfg(s3_server, block_size=16 * KiB)  # 12 tensors of ~32 KiB: dozens of GETs, 2 workers
    with streamer.open(f"s3://{BUCKET}/single/", config=config) as handle:
        got = handle.load_all()
        assert handle.metrics["requests"] > 8
    assert_same_dict(got, reference_load(single.shards))
    assert looked_up == [s3_server.removeprefix("http://")]

"""The local cache in front of S3 (``StreamerConfig.cache``) against a real S3 server (moto).

A miss then a hit are bit-exact and the hit makes no data GET; the cache is independent of the
run's layout (another block size hits too); partial caches are served partly from disk; a replaced
object is a miss; a corrupted, torn or half-written chunk is never served; processes filling at
once fetch each chunk once; ``max_bytes`` holds; a directory that cannot be written degrades to
no cache with one warning; nothing is left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    KiB,
    Written,
    assert_same_dict,
    fd_count,
    loopback_s3_config,
    random_tensor,
    reference_load,
    s3_client,
    s3_stored,
    settled_thread_count,
    thread_count,
    write_checkpoint,
)
from s3_faults import FaultProxy

import streamer
from streamer import CacheConfig, StreamerConfig
from streamer.backends.cache import feed as cache_feed
from streamer.backends.cache import notes
from streamer.backends.cache import store as cache_store
from streamer.backends.cache.store import CacheWarning
from streamer.backends.s3.storage import S3Storage
from streamer.host.safedir import Access

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

BUCKET = "cached"
CREDENTIALS = ("AKIDCACHETEST", "cache/secret", "cache-token")
CHUNK = 64 * KiB


@pytest.fixture(scope="module")
def s3(s3_server: str) -> Any:
    client = s3_client(s3_server, CREDENTIALS[0], CREDENTIALS[1])
    client.create_bucket(Bucket=BUCKET)
    return client


def upload(s3: Any, written: Written, prefix: str) -> None:
    for shard in written.shards:
        s3.upload_file(str(shard), BUCKET, f"{prefix}/{shard.name}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, s3: Any) -> Written:
    """Two shards of about 600 KiB: ten 64 KiB chunks each."""
    g = torch.Generator().manual_seed(7)
    tensors = {f"w{i}": random_tensor((37 * KiB + 11 * i,), torch.float16, g) for i in range(16)}
    written = write_checkpoint(tmp_path_factory.mktemp("cachemodel"), tensors, shards=2)
    upload(s3, written, "model")
    return written


def cfg(
    endpoint: str,
    cache_dir: Path | str,
    *,
    block_size: int = 48 * KiB,
    chunk_bytes: int = CHUNK,
    **cache: Any,
) -> StreamerConfig:
    return StreamerConfig(
        concurrency=2,
        block_size=block_size,
        s3=loopback_s3_config(endpoint, CREDENTIALS, concurrency=4),
        cache=CacheConfig(dir=str(cache_dir), chunk_bytes=chunk_bytes, **cache),
    )


def load(source: Any, config: StreamerConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with streamer.open(source, config=config, order="checkpoint") as handle:
        tensors = dict(iter(handle))
        return tensors, handle.metrics


def fill(source: Any, config: StreamerConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A load that fills the cache, again while a busy disk made it drop a chunk (by design, a
    write never holds up the GETs): after it, every chunk is in the cache."""
    for _ in range(5):
        got, metrics = load(source, config)
        if metrics["cache_dropped"] == 0:
            return got, metrics
    raise AssertionError("five loads in a row dropped chunks: the cache's disk is far behind")


def chunk_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("v3/*/*.chunk"))


def chunks_of(written: Written) -> int:
    return sum(-(-shard.stat().st_size // CHUNK) for shard in written.shards)


def prefix(s3_server: str) -> str:
    return f"s3://{BUCKET}/model/"


def test_miss_then_hit_bit_exact_with_no_data_get(s3_server: str, model: Written, tmp_path: Path) -> None:
    expected = reference_load(model.shards)
    load(f"s3://{BUCKET}/model/{model.shards[0].name}", cfg(s3_server, tmp_path / "warm-up"))
    threads, fds = thread_count(), fd_count()
    got, first = load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert_same_dict(got, expected)
    assert first["cache_errors"] == 0
    # Each chunk once, blocks straddle. A busy disk makes the load drop a write rather than hold up
    # its GETs; a chunk shared by two blocks is then fetched again for the second, at most one more
    # GET per drop.
    requests, dropped = first["requests"] - first["retries"], first["cache_dropped"]
    assert chunks_of(model) <= requests <= chunks_of(model) + dropped
    assert first["cache_hit_bytes"] + first["cache_miss_bytes"] == first["bytes"]
    assert chunks_of(model) - dropped <= len(chunk_files(tmp_path)) <= chunks_of(model)
    if dropped == 0:
        assert first["cache_write_bytes"] == sum(s.stat().st_size for s in model.shards)
    fill(prefix(s3_server), cfg(s3_server, tmp_path))
    # Another layout (block size, whole-object reads) hits all the same.
    got, second = load(prefix(s3_server), cfg(s3_server, tmp_path, block_size=100 * KiB))
    assert_same_dict(got, expected)
    assert second["requests"] == 0 and second["cache_miss_bytes"] == 0
    assert second["cache_hit_bytes"] == second["bytes"] and second["cache_write_bytes"] == 0
    until = time.monotonic() + 5  # moto's own handler threads finish their last response
    while (thread_count() > threads or fd_count() > fds) and time.monotonic() < until:
        time.sleep(0.05)
    assert thread_count() <= threads and fd_count() <= fds  # fewer: a moto thread of the warm-up ended
    assert not [t for t in threading.enumerate() if t.name.startswith("streamer-cache")]


def test_loads_through_the_cache_leave_garbage_collection_on(
    s3_server: str, model: Written, tmp_path: Path
) -> None:
    """The cache's runs read chunks on threads of their own and no feed of theirs ends a hold: its
    opens, fresh or noted (and confirmed on a thread), never hold collection off."""
    was = gc.isenabled()
    gc.enable()
    try:
        for _ in range(2):  # a fresh open, then a noted one
            with streamer.open(prefix(s3_server), config=cfg(s3_server, tmp_path)) as handle:
                assert gc.isenabled()
                got = dict(iter(handle))
                assert gc.isenabled()
            assert_same_dict(got, reference_load(model.shards))
    finally:
        if not was:
            gc.disable()


def test_partial_hits_some_files_some_chunks(s3_server: str, model: Written, tmp_path: Path) -> None:
    expected = reference_load(model.shards)
    one = f"s3://{BUCKET}/model/{model.shards[0].name}"
    got, _ = fill(one, cfg(s3_server, tmp_path))
    assert_same_dict(got, reference_load(model.shards[:1]))
    got, mixed = load(prefix(s3_server), cfg(s3_server, tmp_path))  # shard 0 cached, shard 1 not
    assert_same_dict(got, expected)
    assert mixed["requests"] - mixed["retries"] == -(-model.shards[1].stat().st_size // CHUNK)
    assert mixed["cache_hit_bytes"] > 0 and mixed["cache_miss_bytes"] > 0
    removed = chunk_files(tmp_path)[::3]
    for path in removed:
        path.unlink()
    got, chunks = load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert_same_dict(got, expected)
    # The removed chunks, and at most one more per write a busy disk made a load drop.
    refetched = chunks["requests"] - chunks["retries"]
    assert len(removed) <= refetched <= len(removed) + mixed["cache_dropped"] + chunks["cache_dropped"]
    assert chunks["cache_hit_bytes"] > 0
    assert chunks_of(model) - chunks["cache_dropped"] <= len(chunk_files(tmp_path)) <= chunks_of(model)


def test_replaced_object_is_a_miss(s3_server: str, s3: Any, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(11)
    key = "replaced/model.safetensors"
    versions = []
    for version in range(2):
        tensors = {f"t{i}": random_tensor((30 * KiB,), torch.float32, g) for i in range(4)}
        written = write_checkpoint(tmp_path / f"v{version}", tensors, index=False)
        versions.append(written)
    source = f"s3://{BUCKET}/{key}"
    s3.upload_file(str(versions[0].shards[0]), BUCKET, key)
    got, _ = load(source, cfg(s3_server, tmp_path / "cache"))
    assert_same_dict(got, reference_load(versions[0].shards))
    s3.upload_file(str(versions[1].shards[0]), BUCKET, key)  # same size, other bytes and ETag
    got, metrics = load(source, cfg(s3_server, tmp_path / "cache"))
    assert_same_dict(got, reference_load(versions[1].shards))
    assert metrics["requests"] - metrics["retries"] == chunks_of(versions[1])  # every chunk fetched again


def test_corrupted_chunk_is_refetched_and_rewritten(s3_server: str, model: Written, tmp_path: Path) -> None:
    expected = reference_load(model.shards)
    fill(prefix(s3_server), cfg(s3_server, tmp_path))
    victims = chunk_files(tmp_path)[2:4]
    data = bytearray(victims[0].read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit of data
    victims[0].write_bytes(bytes(data))
    victims[1].write_bytes(victims[1].read_bytes()[:-100])  # a torn chunk
    got, metrics = load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert_same_dict(got, expected)
    # Both chunks fetched again (once more per write a busy disk made the load drop) and rewritten.
    dropped = metrics["cache_dropped"]
    assert metrics["cache_errors"] == 2 and 2 <= metrics["requests"] - metrics["retries"] <= 2 + dropped
    got, again = load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert_same_dict(got, expected)
    assert again["cache_errors"] <= dropped
    if dropped == 0:
        assert again["cache_errors"] == again["requests"] == 0


def test_blocks_inside_large_chunks_hit_and_a_bad_piece_is_refetched(
    s3_server: str, model: Written, tmp_path: Path
) -> None:
    """Chunks of 256 KiB under blocks of 200 KiB: hits read whole checksummed pieces straight into
    the run's buffers and only the edges through a scratch piece; a bit flipped inside one piece
    fails the block reading it, and that chunk alone is fetched again."""
    expected = reference_load(model.shards)
    config = cfg(s3_server, tmp_path, block_size=200 * KiB, chunk_bytes=256 * KiB)
    got, _ = fill(prefix(s3_server), config)
    assert_same_dict(got, expected)
    got, hit = load(prefix(s3_server), config)
    assert_same_dict(got, expected)
    assert hit["requests"] == 0 and hit["cache_hit_bytes"] == hit["bytes"]
    victim = chunk_files(tmp_path)[1]
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    got, healed = load(prefix(s3_server), config)
    assert_same_dict(got, expected)
    assert healed["cache_errors"] == 1 and healed["requests"] - healed["retries"] == 1


def test_blocks_holding_whole_chunks_fetch_and_write_them_in_place(
    s3_server: str, model: Written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``block_size == chunk_bytes``: the cache plans blocks on the file's chunk grid, so every
    chunk but the one under each header is fetched straight into the run's memory and written
    from there; only those few go through a shared buffer."""
    shared_buffers = 0

    class CountedBuffer(cache_feed.ChunkBuffer):
        def __init__(self, capacity: int) -> None:
            nonlocal shared_buffers
            shared_buffers += 1
            super().__init__(capacity)

    monkeypatch.setattr(cache_feed, "ChunkBuffer", CountedBuffer)
    expected = reference_load(model.shards)
    config = cfg(s3_server, tmp_path, block_size=CHUNK)
    got, first = load(prefix(s3_server), config)
    assert_same_dict(got, expected)
    # A busy disk makes a load drop writes rather than hold up GETs: a shared chunk is then
    # fetched again for its next block, at most one more GET per drop.
    requests, dropped = first["requests"] - first["retries"], first["cache_dropped"]
    assert chunks_of(model) <= requests <= chunks_of(model) + dropped
    assert chunks_of(model) - dropped <= len(chunk_files(tmp_path)) <= chunks_of(model)
    if dropped == 0:
        assert first["cache_write_bytes"] == sum(s.stat().st_size for s in model.shards)
    assert 1 <= shared_buffers <= len(model.shards)
    fill(prefix(s3_server), config)
    got, hit = load(prefix(s3_server), config)
    assert_same_dict(got, expected)
    assert hit["requests"] == 0 and hit["cache_hit_bytes"] == hit["bytes"]
    got, other = load(prefix(s3_server), cfg(s3_server, tmp_path))  # another layout: all hits too
    assert_same_dict(got, expected)
    assert other["requests"] == 0


def test_a_fill_holds_a_chunk_lock_per_fetch_in_flight_or_write_only(
    s3_server: str, model: Written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of eight chunks, 4 GETs in flight: at most 4 + 4 of the 20 chunk locks (a file
    descriptor each) are held at any time, one per GET in flight or chunk waiting for its write,
    however far the blocks run ahead of the GETs. A checkpoint of thousands of chunks must not
    run out of descriptors."""
    held = most = 0
    counting = threading.Lock()
    lock, release = cache_store.ChunkStore.lock, cache_store.ChunkLock.release

    def counted_lock(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal held, most
        taken = lock(self, *args, **kwargs)
        if taken is not None:
            with counting:
                held += 1
                most = max(most, held)
        return taken

    def counted_release(self: Any) -> None:
        nonlocal held
        if self._fd is not None:
            with counting:
                held -= 1
        release(self)

    monkeypatch.setattr(cache_store.ChunkStore, "lock", counted_lock)
    monkeypatch.setattr(cache_store.ChunkLock, "release", counted_release)
    got, metrics = load(prefix(s3_server), cfg(s3_server, tmp_path, block_size=8 * CHUNK))
    assert_same_dict(got, reference_load(model.shards))
    assert metrics["cache_miss_bytes"] == metrics["bytes"]
    assert 1 <= most <= 4 + 4 and held == 0


@contextlib.contextmanager
def a_fill_held_elsewhere(cache_dir: Path) -> Iterator[None]:
    """A shard's chunk 0 (under its first blocks) missing, and its lock held as another process
    filling it would hold it."""
    victim = next(p for p in chunk_files(cache_dir) if p.name == "0.chunk")
    victim.unlink()
    other = os.open(victim.with_name("0.lock"), os.O_RDWR)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        yield
    finally:
        os.close(other)


def test_closing_mid_load_ends_a_wait_for_another_process_fill(
    s3_server: str, model: Written, tmp_path: Path
) -> None:
    """Another process holds a missing chunk's lock (it is filling it): the load waits for it,
    but closing the handle after the first tensor ends that wait at once, with no thread or
    descriptor left behind."""
    config = cfg(s3_server, tmp_path)
    fill(prefix(s3_server), config)
    threads, fds = thread_count(), fd_count()
    with a_fill_held_elsewhere(tmp_path):
        started = time.monotonic()
        with streamer.open(prefix(s3_server), config=config) as handle:
            next(iter(handle))
        assert time.monotonic() - started < cache_feed._FILL_WAIT / 2
    until = time.monotonic() + 5
    while (thread_count() > threads or fd_count() > fds) and time.monotonic() < until:
        time.sleep(0.05)
    assert thread_count() <= threads and fd_count() <= fds


def test_a_wait_for_another_process_fill_ends_at_the_load_deadline(
    s3_server: str, model: Written, tmp_path: Path
) -> None:
    """Another process holds a missing chunk's lock and never finishes: a load with a 2 s
    ``load_deadline`` fails naming the deadline, long before the 60 s fill wait."""
    fill(prefix(s3_server), cfg(s3_server, tmp_path))
    s3 = loopback_s3_config(s3_server, CREDENTIALS, concurrency=4, load_deadline=2.0)
    config = dataclasses.replace(cfg(s3_server, tmp_path), s3=s3)
    with a_fill_held_elsewhere(tmp_path):
        started = time.monotonic()
        with pytest.raises(streamer.S3Error) as caught:
            load(prefix(s3_server), config)
        assert time.monotonic() - started < cache_feed._FILL_WAIT / 2
    assert "deadline" in str(caught.value)


def test_no_memory_for_a_chunk_buffer_fails_the_load_naming_the_object(
    s3_server: str, model: Written, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared buffer of a chunk that blocks straddle cannot be mapped (ENOMEM): the load
    ends with an S3Error naming the object, not a hang, and leaves no cache thread behind."""

    class NoMemory(cache_feed.ChunkBuffer):
        def __init__(self, capacity: int) -> None:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(cache_feed, "ChunkBuffer", NoMemory)
    with pytest.raises(streamer.S3Error) as caught:
        load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert "model/" in str(caught.value) and "Cannot allocate memory" in str(caught.value)
    until = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name.startswith("streamer-cache")]:
        assert time.monotonic() < until, "cache threads left behind"
        time.sleep(0.05)


@pytest.mark.parametrize("block_size", [48 * KiB, CHUNK], ids=["shared-chunks", "whole-chunks"])
def test_an_object_vanishing_mid_fill_fails_the_load_naming_it(
    s3_server: str, s3: Any, model: Written, tmp_path: Path, block_size: int
) -> None:
    """Headers read, then the objects are deleted: the load raises an S3Error naming the key,
    and leaves no thread or temporary file behind."""
    upload(s3, model, f"vanish-{block_size}")
    source = f"s3://{BUCKET}/vanish-{block_size}/"
    config = cfg(s3_server, tmp_path, block_size=block_size)
    with pytest.raises(streamer.S3Error) as caught, streamer.open(source, config=config) as handle:
        for shard in model.shards:
            s3.delete_object(Bucket=BUCKET, Key=f"vanish-{block_size}/{shard.name}")
        for _ in handle:
            pass
    assert f"vanish-{block_size}/" in str(caught.value)

    def cache_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("streamer-cache")]

    until = time.monotonic() + 5
    while cache_threads() and time.monotonic() < until:
        time.sleep(0.05)
    assert not cache_threads()
    assert not list(tmp_path.glob("v3/*/*.tmp.*"))


_LOADER = """
import json, sys, time
import streamer
from streamer import CacheConfig, S3Config, StreamerConfig
endpoint, cache_dir, source, start, key, secret, token, chunk = sys.argv[1:9]
s3 = S3Config(endpoint_url=endpoint, region="us-east-1", addressing_style="path",
              access_key_id=key, secret_access_key=secret, session_token=token, concurrency=4)
config = StreamerConfig(concurrency=2, block_size=48 * 1024, s3=s3,
                        cache=CacheConfig(dir=cache_dir, chunk_bytes=int(chunk)))
while time.time() < float(start):
    time.sleep(0.001)
with streamer.open(source, config=config) as handle:
    for _ in handle:
        pass
    print(json.dumps(handle.metrics))
"""


def loader(s3_server: str, cache_dir: Path, start: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LOADER,
            s3_server,
            str(cache_dir),
            prefix(s3_server),
            str(start),
            *CREDENTIALS,
            str(CHUNK),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",  # the installed package, not the source tree
    )


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_filling_at_once_fetch_each_chunk_once(
    s3_server: str, model: Written, tmp_path: Path, processes: int
) -> None:
    start = time.time() + 3.0  # every process imported and connected by then
    running = [loader(s3_server, tmp_path, start) for _ in range(processes)]
    outputs = [p.communicate(timeout=120)[0] for p in running]
    assert all(p.returncode == 0 for p in running)
    metrics = [json.loads(out) for out in outputs]
    # One GET per chunk over all processes (a retried GET counts as a request and a retry). A
    # busy disk makes a process drop a write rather than hold up its GETs: the next process that
    # takes that chunk's lock finds it missing and fetches it again, so at most one more per drop.
    requests = sum(m["requests"] - m["retries"] for m in metrics)
    dropped = sum(m["cache_dropped"] for m in metrics)
    assert chunks_of(model) <= requests <= chunks_of(model) + dropped
    if dropped == 0:
        assert sum(m["cache_write_bytes"] for m in metrics) == sum(s.stat().st_size for s in model.shards)
    fill(prefix(s3_server), cfg(s3_server, tmp_path))
    got, hit = load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert_same_dict(got, reference_load(model.shards))
    assert hit["requests"] == 0


def test_kill_during_fill_leaves_a_correct_cache(s3_server: str, model: Written, tmp_path: Path) -> None:
    process = loader(s3_server, tmp_path, time.time())
    until = time.monotonic() + 60
    while not chunk_files(tmp_path) and time.monotonic() < until and process.poll() is None:
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    ident = tmp_path / "v3" / os.listdir(tmp_path / "v3")[0]
    (ident / "7.chunk.tmp.999999999.1").write_bytes(b"torn")  # a temporary file of a dead process
    got, metrics = load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert_same_dict(got, reference_load(model.shards))
    assert metrics["cache_errors"] == 0
    assert not list(tmp_path.glob("v3/*/*.tmp.*"))  # cleaned when the cache was opened
    assert chunks_of(model) - metrics["cache_dropped"] <= len(chunk_files(tmp_path)) <= chunks_of(model)


def test_eviction_keeps_max_bytes(s3_server: str, model: Written, tmp_path: Path) -> None:
    limit = 4 * CHUNK + 200
    got, _ = load(prefix(s3_server), cfg(s3_server, tmp_path, max_bytes=limit))
    assert_same_dict(got, reference_load(model.shards))
    stored = chunk_files(tmp_path)
    # 3 whole chunks fit, or more with a shard's short last chunks among them: the bound is bytes
    assert 0 < len(stored) < chunks_of(model)
    assert sum(p.stat().st_size for p in stored) <= limit
    got, _ = load(prefix(s3_server), cfg(s3_server, tmp_path, max_bytes=limit))
    assert_same_dict(got, reference_load(model.shards))
    assert sum(p.stat().st_size for p in chunk_files(tmp_path)) <= limit


def test_unwritable_directory_loads_with_one_warning(s3_server: str, model: Written) -> None:
    # sysfs refuses new entries even to root (chmod would not stop root): EPERM on mkdir.
    with pytest.warns(CacheWarning) as caught:
        got, metrics = load(prefix(s3_server), cfg(s3_server, "/sys/streamer-cache"))
    assert_same_dict(got, reference_load(model.shards))
    assert len(caught) == 1 and metrics["cache_write_bytes"] == 0


def test_full_disk_loads_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, s3_server: str, model: Written, tmp_path: Path
) -> None:
    """ENOSPC is injected at the cache's write call (no small file system without root)."""
    writes = 0

    def full(fd: int, data: Any, position: int) -> None:
        nonlocal writes
        writes += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache_store, "_write_all", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, metrics = load(prefix(s3_server), cfg(s3_server, tmp_path))
    assert_same_dict(got, reference_load(model.shards))
    assert [w.category for w in caught] == [CacheWarning] and "ENOSPC" in str(caught[0].message)
    assert writes >= 1 and metrics["cache_write_bytes"] == 0
    assert not chunk_files(tmp_path) and not list(tmp_path.glob("v3/*/*.tmp.*"))


def test_cache_config_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert StreamerConfig().cache.dir is None
    monkeypatch.setenv("STREAMER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STREAMER_CACHE_MAX_BYTES", "3GiB")
    cache = StreamerConfig().cache
    assert cache.dir == str(tmp_path) and cache.max_bytes == 3 * 1024**3
    with pytest.raises(streamer.ConfigError):
        CacheConfig(dir=str(tmp_path), max_bytes=0)


def test_vllm_plugin_cache_keys(tmp_path: Path) -> None:
    from streamer_vllm.options import parse_options

    options = parse_options({"cache_dir": str(tmp_path), "cache_max_bytes": "2GiB"})
    assert options.config.cache == CacheConfig(dir=str(tmp_path), max_bytes=2 * 1024**3)
    assert parse_options({}).config.cache.dir is None
    with pytest.raises(streamer.ConfigError):
        parse_options({"cache_max_bytes": 0})


# --- provisional opens: a hit reads from the cache's note of the source while S3 answers ----------


def any_request(method: str, path: str, headers: Any) -> bool:
    return True


def note_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("opens/*.note"))


class GatedOpen:
    """S3 opens (the confirmation of a provisional open) wait for ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        real = S3Storage.open

        def gated(storage: S3Storage, source: Any) -> Any:
            self.entered.set()
            assert self.release.wait(60)
            return real(storage, source)

        monkeypatch.setattr(S3Storage, "open", gated)


def test_a_hit_reads_the_cache_before_s3_answers_and_hands_nothing_on_before(
    monkeypatch: pytest.MonkeyPatch, s3_server: str, model: Written, tmp_path: Path
) -> None:
    fill(prefix(s3_server), cfg(s3_server, tmp_path))  # fills the cache and notes the source
    assert len(note_files(tmp_path)) == 1
    before = time.time() - 1
    for path in chunk_files(tmp_path):
        os.utime(path, (before, before))
    gate = GatedOpen(monkeypatch)
    handed: list[tuple[str, torch.Tensor]] = []
    handle = streamer.open(prefix(s3_server), config=cfg(s3_server, tmp_path), order="checkpoint")
    reader = threading.Thread(target=lambda: handed.extend(iter(handle)))  # len(handle) would wait
    reader.start()
    try:
        assert gate.entered.wait(30)
        # A hit touches its chunk (LRU): every chunk is read while S3 has not answered.
        until = time.monotonic() + 30
        while time.monotonic() < until and any(p.stat().st_mtime <= before for p in chunk_files(tmp_path)):
            time.sleep(0.01)
        assert [p.name for p in chunk_files(tmp_path) if p.stat().st_mtime <= before] == []
        assert reader.is_alive() and not handed
    finally:
        gate.release.set()
        reader.join(60)
    assert_same_dict(dict(handed), reference_load(model.shards))
    metrics = handle.metrics
    handle.close()
    assert metrics["requests"] == 0 and metrics["cache_hit_bytes"] == metrics["bytes"]


def test_a_source_that_changed_since_its_note_loads_as_it_is_now(
    s3_server: str, s3: Any, tmp_path: Path
) -> None:
    """Another listing, other tensors (names, shapes), other sizes: every API plans from S3's
    answer (the stale note is put back before each)."""
    g = torch.Generator().manual_seed(5)
    old_tensors = {f"a{i}": random_tensor((20 * KiB,), torch.float16, g) for i in range(6)}
    new_tensors = {f"b{i}": random_tensor((9 * KiB + i, 3), torch.bfloat16, g) for i in range(9)}
    old = write_checkpoint(tmp_path / "old", old_tensors, shards=2)
    new = write_checkpoint(tmp_path / "new", new_tensors, shards=3)
    upload(s3, old, "changing")
    source = f"s3://{BUCKET}/changing/"
    config = cfg(s3_server, tmp_path / "cache")
    got, _ = load(source, config)
    assert_same_dict(got, reference_load(old.shards))
    (note,) = note_files(tmp_path / "cache")
    stale = note.read_bytes()
    for shard in old.shards:
        s3.delete_object(Bucket=BUCKET, Key=f"changing/{shard.name}")
    upload(s3, new, "changing")
    expected = reference_load(new.shards)

    def from_stale_note() -> StreamerConfig:
        note.write_bytes(stale)
        return config

    got, metrics = load(source, from_stale_note())
    assert_same_dict(got, expected)
    assert metrics["bytes"] == sum(t.nbytes for t in expected.values())
    assert_same_dict(streamer.load(source, config=from_stale_note()), expected)
    with streamer.open(source, config=from_stale_note()) as handle:
        assert handle.keys() == list(expected)
    with streamer.open(source, config=from_stale_note()) as handle:
        assert_same_dict({"b3": handle.get_tensor("b3")}, {"b3": expected["b3"]})
    with streamer.safe_open(source, config=from_stale_note()) as opened:
        assert_same_dict({"b3": opened.get_slice("b3")[1:5]}, {"b3": expected["b3"][1:5]})
    dest = {name: torch.empty_like(t) for name, t in expected.items()}
    streamer.load_into(dest, source, config=from_stale_note())
    assert_same_dict(dest, expected)
    assert note.read_bytes() != stale  # noted as it is now


def test_an_object_gone_since_its_note_is_an_error_not_a_hit(
    s3_server: str, s3: Any, model: Written, tmp_path: Path
) -> None:
    upload(s3, model, "gone")
    source = f"s3://{BUCKET}/gone/{model.shards[0].name}"
    config = cfg(s3_server, tmp_path)
    load(source, config)
    s3.delete_object(Bucket=BUCKET, Key=f"gone/{model.shards[0].name}")
    with pytest.raises(streamer.S3MissingError, match="gone/"):
        load(source, config)
    with pytest.raises(streamer.S3MissingError), streamer.open(source, config=config) as handle:
        handle.keys()
    with pytest.raises(streamer.S3MissingError):
        streamer.load_into({}, source, config=config, strict=False)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_a_damaged_note_is_no_note(s3_server: str, model: Written, tmp_path: Path, damage: str) -> None:
    config = cfg(s3_server, tmp_path)
    fill(prefix(s3_server), config)
    (note,) = note_files(tmp_path)
    data = bytearray(note.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        del data[-10:]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"STRMOP02" + bytes(100))
    note.write_bytes(bytes(data))
    got, metrics = load(prefix(s3_server), config)
    assert_same_dict(got, reference_load(model.shards))
    assert metrics["requests"] == 0
    noted = notes.NoteOf(config.s3.endpoint_url, (prefix(s3_server),))
    assert note.stem == noted.key
    assert notes.OpenNotes(str(tmp_path), Access(), s3_stored).read(noted) is not None  # noted again


def test_closing_a_handle_before_s3_answers_leaves_nothing_running(
    monkeypatch: pytest.MonkeyPatch, s3_server: str, model: Written, tmp_path: Path
) -> None:
    config = cfg(s3_server, tmp_path)
    fill(prefix(s3_server), config)
    threads, fds = thread_count(), fd_count()
    gate = GatedOpen(monkeypatch)
    handle = streamer.open(prefix(s3_server), config=config)
    assert gate.entered.wait(30)
    threading.Timer(0.2, gate.release.set).start()
    handle.close()
    until = time.monotonic() + 5
    while (thread_count() > threads or fd_count() > fds) and time.monotonic() < until:
        time.sleep(0.05)
    assert thread_count() <= threads and fd_count() <= fds
    assert not [t for t in threading.enumerate() if t.name.startswith("streamer")]


def test_no_note_when_a_header_is_longer_than_the_front_read(
    s3_server: str, model: Written, tmp_path: Path
) -> None:
    config = cfg(s3_server, tmp_path)
    config = dataclasses.replace(config, s3=dataclasses.replace(config.s3, header_bytes=64))
    got, _ = fill(prefix(s3_server), config)
    assert_same_dict(got, reference_load(model.shards))
    assert not note_files(tmp_path)
    got, metrics = load(prefix(s3_server), config)
    assert_same_dict(got, reference_load(model.shards))
    assert metrics["requests"] == 0


@pytest.mark.parametrize("kind", ["503", "reset", "short", "stall"])
def test_a_server_failing_while_it_confirms_a_note_is_retried_or_a_typed_error(
    s3_server: str, model: Written, tmp_path: Path, kind: str
) -> None:
    """The open that confirms a note meets the server's faults (on every GET, the listing's too):
    a few are retried and the hit is bit-exact; persistent ones end the load with a typed S3 error
    within the retry bounds, nothing handed on and nothing left running."""
    host, port = s3_server.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)), stall_seconds=3.0)
    try:
        config = cfg(proxy.endpoint_url, tmp_path)
        fill(prefix(s3_server), config)  # fills the cache and notes the source, through the proxy
        proxy.inject(kind, times=2, match=any_request)
        got, metrics = load(prefix(s3_server), config)
        assert_same_dict(got, reference_load(model.shards))
        assert proxy.injected == 2 and metrics["cache_hit_bytes"] == metrics["bytes"]
        threads = thread_count()
        proxy.inject(kind, times=None, match=any_request)
        handed: list[str] = []
        source = prefix(s3_server)
        with pytest.raises(streamer.S3Error) as caught, streamer.open(source, config=config) as handle:
            handed.extend(name for name, _ in handle)
        assert not handed and caught.value.attempts >= 1
    finally:
        proxy.close()
    assert settled_thread_count(threads, seconds=5) <= threads
    assert not [t for t in threading.enumerate() if t.name.startswith("streamer")]


def test_a_note_of_objects_now_denied_is_an_access_error_not_a_hit(
    s3_server: str, model: Written, tmp_path: Path
) -> None:
    host, port = s3_server.removeprefix("http://").split(":")
    proxy = FaultProxy((host, int(port)))
    try:
        config = cfg(proxy.endpoint_url, tmp_path)
        load(prefix(s3_server), config)
        proxy.inject("403", times=None, match=any_request)
        with pytest.raises(streamer.S3SourceError, match="access denied") as caught:
            load(prefix(s3_server), config)
        assert caught.value.status == 403 and caught.value.attempts == 1
        with pytest.raises(streamer.S3SourceError, match="access denied"):
            streamer.load_into({}, prefix(s3_server), config=config, strict=False)
    finally:
        proxy.close()

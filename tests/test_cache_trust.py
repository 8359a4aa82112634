"""The node cache against what another hand can do to its files: chunk files swapped between two
objects of the same size or renamed between offsets, notes copied from one source to another, a
directory that another user owns or that others may write. None of it may put a wrong byte in a
tensor: a foreign chunk is a miss (fetched again, rewritten, counted in ``cache_errors``), a
foreign note is no note, and a directory others can write is not used (one ``CacheWarning``).
Runs as root here, so "another user" is a chown to 65534, or a worker dropped to it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    KiB,
    Written,
    assert_same_dict,
    loopback_s3_config,
    random_tensor,
    reference_load,
    s3_client,
    s3_stored,
    write_checkpoint,
)

import streamer
from streamer import CacheConfig, ConfigError, StreamerConfig
from streamer.backends.cache.notes import NoteOf, OpenNotes
from streamer.backends.cache.store import CacheWarning, identity
from streamer.host.safedir import Access

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

BUCKET = "trust"
CREDENTIALS = ("AKIDTRUSTTEST", "trust/secret", "trust-token")
CHUNK = 64 * KiB
NOBODY = 65534


@pytest.fixture(scope="module")
def s3(s3_server: str) -> Any:
    client = s3_client(s3_server, CREDENTIALS[0], CREDENTIALS[1])
    client.create_bucket(Bucket=BUCKET)
    return client


def _model(directory: Path, seed: int) -> Written:
    """One file of 16 tensors: the same names, shapes and so size for every seed, other bytes."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"w{i}": random_tensor((9 * KiB,), torch.float32, g) for i in range(16)}
    return write_checkpoint(directory, tensors, index=False)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory, s3: Any) -> tuple[Written, Written]:
    """Two objects of exactly the same size (and header) with different bytes."""
    a = _model(tmp_path_factory.mktemp("twin-a"), seed=1)
    b = _model(tmp_path_factory.mktemp("twin-b"), seed=2)
    assert a.shards[0].stat().st_size == b.shards[0].stat().st_size
    s3.upload_file(str(a.shards[0]), BUCKET, "a/model.safetensors")
    s3.upload_file(str(b.shards[0]), BUCKET, "b/model.safetensors")
    return a, b


def cfg(endpoint: str, cache_dir: Path, **cache: Any) -> StreamerConfig:
    return StreamerConfig(
        concurrency=2,
        block_size=CHUNK,
        s3=loopback_s3_config(endpoint, CREDENTIALS, concurrency=4),
        cache=CacheConfig(dir=str(cache_dir), chunk_bytes=CHUNK, **cache),
    )


def load(source: str, config: StreamerConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with streamer.open(source, config=config, order="checkpoint") as handle:
        return dict(iter(handle)), handle.metrics


def chunk_dir(cache: Path, s3_server: str, key: str, size: int) -> Path:
    """The directory of an object's chunks (named by its identity, as the store names it)."""
    etag = s3_client(s3_server, CREDENTIALS[0], CREDENTIALS[1]).head_object(Bucket=BUCKET, Key=key)["ETag"]
    return cache / "v3" / identity(s3_server, BUCKET, key, size, etag)


# --- chunks bound to their object and offset ---------------------------------------------------


def test_chunk_files_swapped_between_two_objects_are_misses_not_each_others_bytes(
    s3_server: str, twins: tuple[Written, Written], tmp_path: Path
) -> None:
    a, b = twins
    size = a.shards[0].stat().st_size
    config = cfg(s3_server, tmp_path)
    for name in ("a", "b"):
        load(f"s3://{BUCKET}/{name}/model.safetensors", config)
    dir_a = chunk_dir(tmp_path, s3_server, "a/model.safetensors", size)
    dir_b = chunk_dir(tmp_path, s3_server, "b/model.safetensors", size)
    chunks = sorted(p.name for p in dir_a.glob("*.chunk"))
    assert chunks == sorted(p.name for p in dir_b.glob("*.chunk")) and len(chunks) > 2
    swap = tmp_path / "swap"
    swap.mkdir()
    for name in chunks:  # the careless mv, or a restore from the wrong backup
        shutil.move(dir_a / name, swap / name)
        shutil.move(dir_b / name, dir_a / name)
        shutil.move(swap / name, dir_b / name)
    got_a, metrics_a = load(f"s3://{BUCKET}/a/model.safetensors", config)
    got_b, metrics_b = load(f"s3://{BUCKET}/b/model.safetensors", config)
    assert_same_dict(got_a, reference_load(a.shards))
    assert_same_dict(got_b, reference_load(b.shards))
    for metrics in (metrics_a, metrics_b):
        assert metrics["cache_errors"] == len(chunks)
        assert metrics["cache_hit_bytes"] == 0 and metrics["cache_write_bytes"] == size
    # Rewritten: the next loads hit, with no error.
    for name, written in (("a", a), ("b", b)):
        got, metrics = load(f"s3://{BUCKET}/{name}/model.safetensors", config)
        assert_same_dict(got, reference_load(written.shards))
        assert metrics["cache_errors"] == 0 and metrics["requests"] == 0


def test_chunk_files_renamed_between_offsets_are_misses(
    s3_server: str, twins: tuple[Written, Written], tmp_path: Path
) -> None:
    a, _ = twins
    config = cfg(s3_server, tmp_path)
    load(f"s3://{BUCKET}/a/model.safetensors", config)
    directory = chunk_dir(tmp_path, s3_server, "a/model.safetensors", a.shards[0].stat().st_size)
    (directory / "0.chunk").rename(directory / "swap")
    (directory / "1.chunk").rename(directory / "0.chunk")
    (directory / "swap").rename(directory / "1.chunk")
    got, metrics = load(f"s3://{BUCKET}/a/model.safetensors", config)
    assert_same_dict(got, reference_load(a.shards))
    assert metrics["cache_errors"] == 2 and metrics["cache_write_bytes"] == 2 * CHUNK


def test_a_note_copied_from_another_source_is_no_note(
    s3_server: str, twins: tuple[Written, Written], tmp_path: Path
) -> None:
    a, _ = twins
    config = cfg(s3_server, tmp_path)
    source_a, source_b = (f"s3://{BUCKET}/{n}/model.safetensors" for n in ("a", "b"))
    load(source_a, config)
    load(source_b, config)
    of_a, of_b = (NoteOf(config.s3.endpoint_url, (s,)) for s in (source_a, source_b))
    notes = tmp_path / "opens"
    shutil.copy(notes / f"{of_b.key}.note", notes / f"{of_a.key}.note")
    assert OpenNotes(str(tmp_path), Access(), s3_stored).read(of_a) is None
    got, metrics = load(source_a, config)
    assert_same_dict(got, reference_load(a.shards))
    assert metrics["cache_errors"] == 0 and metrics["cache_hit_bytes"] == metrics["bytes"]
    noted = OpenNotes(str(tmp_path), Access(), s3_stored).read(of_a)  # noted again, as itself
    assert noted is not None and noted.source.paths == (source_a,)


# --- who may write the directory ---------------------------------------------------------------


def test_a_new_cache_is_this_users_alone(
    s3_server: str, twins: tuple[Written, Written], tmp_path: Path
) -> None:
    cache = tmp_path / "fresh" / "cache"
    load(f"s3://{BUCKET}/a/model.safetensors", cfg(s3_server, cache))
    made = [cache, *(p for p in cache.rglob("*"))]
    assert any(p.name.endswith(".chunk") for p in made) and any(p.name.endswith(".note") for p in made)
    assert any(p.name.endswith(".lock") for p in made)
    for path in made:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


@pytest.mark.parametrize(
    "damage",
    [
        "owned by another user",
        "world-writable",
        "group-writable",
        "store owned by another user",
        "notes 0777",
    ],
)
def test_a_directory_others_can_write_is_not_used(
    s3_server: str, twins: tuple[Written, Written], tmp_path: Path, damage: str
) -> None:
    a, _ = twins
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if damage == "owned by another user":
        os.chown(cache, NOBODY, NOBODY)
    elif damage == "world-writable":
        cache.chmod(0o777)
    elif damage == "group-writable":
        cache.chmod(0o770)
    elif damage == "store owned by another user":
        (cache / "v3").mkdir(mode=0o700)
        os.chown(cache / "v3", NOBODY, NOBODY)
    else:
        (cache / "opens").mkdir()
        (cache / "opens").chmod(0o777)
    before = sorted(str(p) for p in cache.rglob("*"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, metrics = load(f"s3://{BUCKET}/a/model.safetensors", cfg(s3_server, cache))
    assert_same_dict(got, reference_load(a.shards))
    assert [w.category for w in caught] == [CacheWarning]
    assert str(cache) in str(caught[0].message) and "without the cache" in str(caught[0].message)
    assert metrics["cache_hit_bytes"] == metrics["cache_write_bytes"] == 0 and metrics["requests"] > 0
    assert sorted(str(p) for p in cache.rglob("*")) == before  # nothing read from it, nothing written


def test_another_user_cannot_use_or_poison_this_users_cache(
    s3_server: str, twins: tuple[Written, Written]
) -> None:
    """A process of uid 65534 pointed at root's cache: warned off, loads from S3, writes nothing."""
    a, _ = twins
    top = Path(tempfile.mkdtemp(prefix="streamer-trust-"))  # /tmp, not pytest's 0700 tree
    try:
        top.chmod(0o755)
        cache = top / "cache"
        source = f"s3://{BUCKET}/a/model.safetensors"
        load(source, cfg(s3_server, cache))
        cache.chmod(0o755)  # even readable, it is not theirs to use
        script = textwrap.dedent(
            f"""
            import os, warnings
            import streamer, streamer.backends.cache.storage
            from streamer import CacheConfig, StreamerConfig
            from conftest import loopback_s3_config
            s3 = loopback_s3_config({s3_server!r}, {CREDENTIALS!r})
            streamer.load({source!r}, config=StreamerConfig(s3=s3))  # imports what S3 needs, as root
            os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
            config = StreamerConfig(s3=s3, cache=CacheConfig(dir={str(cache)!r}))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with streamer.open({source!r}, config=config) as handle:
                    print(sum(t.nbytes for _, t in handle), handle.metrics["cache_hit_bytes"])
            print([str(w.message) for w in caught])
            """
        )
        before = sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*"))
        result = subprocess.run(
            [sys.executable, "-c", script],
            cwd=top,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == f"{sum(t.nbytes for t in a.tensors.values())} 0"
        assert "belongs to another user" in lines[1]
        assert sorted((str(p), p.stat().st_mtime_ns) for p in cache.rglob("*")) == before
    finally:
        shutil.rmtree(top)


def test_a_group_shares_a_cache_it_owns(
    s3_server: str, twins: tuple[Written, Written], tmp_path: Path
) -> None:
    a, _ = twins
    cache = tmp_path / "shared"
    config = cfg(s3_server, cache, shared_group=NOBODY)
    load(f"s3://{BUCKET}/a/model.safetensors", config)
    for path in [cache, *cache.rglob("*")]:
        info = path.stat()
        assert info.st_gid == NOBODY, path
        mode = stat.S_IMODE(info.st_mode)
        assert mode == (0o2770 if path.is_dir() else 0o660), (path, oct(mode))
    got, metrics = load(f"s3://{BUCKET}/a/model.safetensors", config)
    assert_same_dict(got, reference_load(a.shards))
    assert metrics["cache_hit_bytes"] == metrics["bytes"]
    # Shared with the group, the directory is not this user's alone: without the group it is refused.
    with pytest.warns(CacheWarning, match="writable by its group"):
        load(f"s3://{BUCKET}/a/model.safetensors", cfg(s3_server, cache))
    # Another group's directory is refused too.
    os.chown(cache, -1, 0)
    with pytest.warns(CacheWarning, match="not the shared group"):
        load(f"s3://{BUCKET}/a/model.safetensors", config)


def test_shared_group_from_the_environment_and_unknown_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMER_CACHE_SHARED_GROUP", "root")
    assert StreamerConfig().cache.access == Access(0)
    assert CacheConfig(shared_group=str(NOBODY)).access == Access(NOBODY)
    assert CacheConfig(shared_group=None).access == Access(None)
    for bad in ("no-such-group-here", "", -1, 3.5):
        with pytest.raises(ConfigError, match="shared_group"):
            CacheConfig(shared_group=bad)  # type: ignore[arg-type]

"""Every way a load can fail ends in one typed ``StreamerError`` naming the file (and the tensor),
raised at the right moment, without a crash or a hang."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import KiB, MiB, Written, assert_same, config, file_layout, random_tensor, write_checkpoint

import streamer
import streamer.backends.local
from streamer import (
    ConfigError,
    DeviceError,
    HeaderError,
    ReadError,
    SourceError,
    StreamerConfig,
    StreamerError,
)

# Small budgets here only keep the reader from running ahead; whether the loader stays under one
# (and warns when it does not) is test_memory_limit.py's subject.
pytestmark = pytest.mark.filterwarnings("ignore:memory_limit:RuntimeWarning")


@pytest.fixture
def small(tmp_path: Path) -> Written:
    g = torch.Generator().manual_seed(2)
    tensors = {f"t{i}": random_tensor((3000 + i,), torch.float32, g) for i in range(6)}
    tensors["empty"] = torch.empty(0)
    return write_checkpoint(tmp_path / "ckpt", tensors, shards=2)


def _loaders(source: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Each public way to start a load of ``source``; headers are read by all of them."""
    return [
        ("load", lambda: streamer.load(source)),
        ("open", lambda: streamer.open(source)),
        ("load_file", lambda: streamer.load_file(source)),
    ]


# --- sources --------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    for how, call in _loaders(missing):
        with pytest.raises(SourceError) as info:
            call()
        assert info.value.path == str(missing), how
        assert str(missing) in str(info.value)
    existing = write_checkpoint(tmp_path, {"a": torch.ones(1)}, index=False).shards[0]
    with pytest.raises(SourceError) as info:
        streamer.open([existing, missing])
    assert info.value.path == str(missing)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"x")
    (tmp_path / "sub.safetensors").mkdir()  # a directory with the suffix is not a file either
    with pytest.raises(SourceError, match=r"no \*\.safetensors") as info:
        streamer.load(tmp_path)
    assert info.value.path == str(tmp_path)


def test_empty_and_repeated_lists(small: Written) -> None:
    with pytest.raises(SourceError, match="empty"):
        streamer.open([])
    with pytest.raises(SourceError, match="twice"):
        streamer.open([small.shards[0], small.shards[0]])


def test_directory_or_fifo_given_as_a_file(tmp_path: Path, deadline: Any) -> None:
    deadline(20)
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)  # nobody writes to it: opening it for reading must not block
    for path in (fifo, tmp_path):
        with pytest.raises(SourceError) as info:
            streamer.open([path])
        assert info.value.path == str(path)
    with pytest.raises(SourceError, match="not a regular file"):
        streamer.load_file(fifo)


def test_index_referencing_a_missing_shard_fails_before_any_read(
    small: Written, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert small.index is not None
    small.shards[1].unlink()
    reads: list[str] = []
    real = streamer.backends.local.read_front
    monkeypatch.setattr(streamer.backends.local, "read_front", lambda p, n: reads.append(p) or real(p, n))
    with pytest.raises(SourceError) as info:
        streamer.open(small.index)
    assert info.value.path == str(small.index)
    assert small.shards[1].name in str(info.value)
    assert reads == [], "no shard may be read when one is missing"


def test_bad_index_files(tmp_path: Path) -> None:
    safetensors.torch.save_file({"a": torch.ones(2)}, str(tmp_path / "s.safetensors"))
    cases = {
        "missing": None,
        "not_json": "{weight_map",
        "no_weight_map": json.dumps({"metadata": {}}),
        "not_strings": json.dumps({"weight_map": {"a": 3}}),
        "empty_map": json.dumps({"weight_map": {}}),
        "a_list": json.dumps(["s.safetensors"]),
        "not_utf8": b"\xff\xfe{",
    }
    for name, content in cases.items():
        index = tmp_path / f"{name}.safetensors.index.json"
        if isinstance(content, str):
            index.write_text(content)
        elif isinstance(content, bytes):
            index.write_bytes(content)
        with pytest.raises(SourceError) as info:
            streamer.open(index)
        assert info.value.path == str(index), name


def test_index_naming_a_tensor_the_shard_lacks(small: Written) -> None:
    assert small.index is not None
    document = json.loads(small.index.read_text())
    document["weight_map"]["ghost.weight"] = small.shards[0].name
    small.index.write_text(json.dumps(document))
    with pytest.raises(SourceError) as info:
        streamer.open(small.index)
    assert info.value.tensor == "ghost.weight"
    assert info.value.path == str(small.index)
    assert small.shards[0].name in str(info.value)


def test_index_placing_a_tensor_in_the_wrong_shard(small: Written) -> None:
    assert small.index is not None
    document = json.loads(small.index.read_text())
    name = next(n for n, f in document["weight_map"].items() if f == small.shards[0].name)
    document["weight_map"][name] = small.shards[1].name
    small.index.write_text(json.dumps(document))
    with pytest.raises(SourceError) as info:
        streamer.open(small.index)
    assert info.value.tensor == name


def test_duplicate_tensor_names_across_shards(tmp_path: Path) -> None:
    safetensors.torch.save_file({"a": torch.ones(2), "dup": torch.ones(3)}, str(tmp_path / "1.safetensors"))
    safetensors.torch.save_file({"dup": torch.zeros(3), "b": torch.ones(1)}, str(tmp_path / "2.safetensors"))
    for source in (tmp_path, [tmp_path / "1.safetensors", tmp_path / "2.safetensors"]):
        with pytest.raises(SourceError) as info:
            streamer.open(source)
        assert info.value.tensor == "dup"
        message = str(info.value)
        assert "1.safetensors" in message and "2.safetensors" in message  # both places named


def test_s3_source_without_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing to sign with: a SourceError naming the object, at once (no request is sent)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never the real AWS
    for source in ("s3://bucket/model.safetensors", "s3://bucket/dir/"):
        with pytest.raises(SourceError, match="credentials") as info:
            streamer.open(source)
        assert info.value.path == source


# --- unreadable files -----------------------------------------------------------------------

_UNREADABLE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import streamer
    import streamer.engine.native
    import torch

    streamer.engine.native._lib()  # load everything while still privileged

    path, mode, drop = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    if drop:  # root reads any file; run the rest as an ordinary user
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    result = {}
    try:
        if mode == "before_open":
            os.chmod(path, 0)
            streamer.open(path)
            result["error"] = None
        else:  # unreadable after the headers were read, before the data is
            s = streamer.open(path, config=streamer.StreamerConfig(concurrency=2, block_size=4096))
            os.chmod(path, 0)
            result["loaded"] = len(dict(iter(s)))
    except streamer.StreamerError as e:
        result = {"error": type(e).__name__, "path": e.path, "tensor": e.tensor, "message": str(e)}
    print(json.dumps(result))
""")


@pytest.mark.parametrize("mode", ["before_open", "after_open"])
def test_unreadable_file(mode: str) -> None:
    """chmod 000 as an ordinary user: as root the test drops to uid 65534 in a subprocess, since
    root ignores file permissions."""
    root = os.geteuid() == 0
    directory = tempfile.mkdtemp(prefix="streamer-unreadable-")  # /tmp, not pytest's 0700 tree
    try:
        os.chmod(directory, 0o755)
        path = os.path.join(directory, "model.safetensors")
        safetensors.torch.save_file({"a": torch.ones(1000), "b": torch.zeros(10)}, path)
        if root:
            os.chown(path, 65534, 65534)  # the unprivileged process must be able to chmod it
        out = subprocess.run(
            [sys.executable, "-c", _UNREADABLE_SCRIPT, path, mode, "1" if root else "0"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=directory,
        )  # not the repository: import the installed package
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(directory)
    assert result.get("error") == "SourceError", result
    assert result["path"] == path
    assert "Permission denied" in result["message"]


# --- truncated files ------------------------------------------------------------------------


def test_header_longer_than_the_file(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header[: len(header) // 2])
    for how, call in _loaders(path):
        with pytest.raises(HeaderError) as info:
            call()
        assert info.value.path == str(path), how


def test_file_truncated_before_open(small: Written) -> None:
    """The header promises more data than the file holds: HeaderError at open, naming a tensor."""
    shard = small.shards[0]
    layout = file_layout(shard)
    cut = layout[-1][1] + 4  # inside the last tensor
    os.truncate(shard, cut)
    for how, call in _loaders(small.index):
        with pytest.raises(HeaderError) as info:
            call()
        assert info.value.path == str(shard), how
        assert info.value.tensor in {n for n, _, end in layout if end > cut}


def _cut_points(layout: list[tuple[str, int, int]]) -> dict[str, int]:
    data_start = layout[0][1]
    nonempty = [row for row in layout if row[2] > row[1]]
    middle = nonempty[len(nonempty) // 2]
    return {
        "empty_file": 0,
        "inside_header": 12,
        "no_data": data_start,
        "mid_tensor": (middle[1] + middle[2]) // 2,
        "last_byte": nonempty[-1][2] - 1,
    }


@pytest.mark.parametrize("where", ["empty_file", "inside_header", "no_data", "mid_tensor", "last_byte"])
@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_file_truncated_after_open(tmp_path: Path, deadline: Any, where: str, io_mode: str) -> None:
    deadline(30)
    g = torch.Generator().manual_seed(4)
    tensors = {f"w{i}": random_tensor((5000 + 7 * i,), torch.float32, g) for i in range(8)}
    path = write_checkpoint(tmp_path, tensors, index=False).shards[0]
    layout = file_layout(path)
    cut = _cut_points(layout)[where]
    first_missing = next(n for n, b, e in layout if e > max(cut, b))  # the first tensor not whole
    incomplete = {n for n, _, e in layout if e > cut}
    for concurrency in (1, 4):
        for use in ("iterate", "get_tensor"):
            shutil.copy(path, tmp_path / "work.safetensors")
            work = tmp_path / "work.safetensors"
            cfg = config(concurrency=concurrency, block_size=4096, io_mode=io_mode)
            s = streamer.open(work, config=cfg)
            os.truncate(work, cut)
            with pytest.raises(ReadError) as info:
                if use == "iterate":
                    for _ in s:
                        pass
                else:
                    s.get_tensor(layout[-1][0])
            s.close()
            error = info.value
            assert error.path == str(work)
            assert (
                error.offset is not None and str(work) in str(error) and f"byte {error.offset}" in str(error)
            )
            if use == "get_tensor":
                assert error.tensor == layout[-1][0]
            elif concurrency == 1:
                assert error.tensor == first_missing, (error, cut)
                assert error.offset <= max(cut, layout[0][1]) < error.offset + 4096 + 4096
            else:
                assert error.tensor in incomplete, (error, cut)


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_a_slice_of_a_file_truncated_after_open_names_file_and_tensor(tmp_path: Path, io_mode: str) -> None:
    """A strided shard (one packed run of many ranges) and a row slice whose bytes were cut off:
    a ``ReadError`` naming the file and the tensor, never a partly filled tensor; no thread or
    descriptor outlives the read."""
    g = torch.Generator().manual_seed(7)
    weight = random_tensor((64, 48 * KiB // 4), torch.float32, g)
    path = tmp_path / "w.safetensors"
    tensors = {"head": random_tensor((16,), torch.int8, g), "weight": weight}
    safetensors.torch.save_file(tensors, str(path))
    _, begin, end = next(t for t in file_layout(path) if t[0] == "weight")
    threads, fds = set(threading.enumerate()), len(os.listdir("/proc/self/fd"))
    for index in [(slice(None), slice(0, 1024)), (slice(40, 64),)]:
        with streamer.safe_open(path, config=config(io_mode=io_mode)) as handle:
            os.truncate(path, (begin + end) // 2)
            with pytest.raises(ReadError) as info:
                handle.get_slice("weight")[index]
        assert info.value.path == str(path) and info.value.tensor == "weight", info.value
        safetensors.torch.save_file(tensors, str(path))
    assert set(threading.enumerate()) - threads == set() and len(os.listdir("/proc/self/fd")) == fds


def test_tensors_before_the_cut_still_arrive_intact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(6)
    tensors = {f"w{i}": random_tensor((4096,), torch.float32, g) for i in range(8)}
    path = write_checkpoint(tmp_path, tensors, index=False).shards[0]
    layout = file_layout(path)
    cut = layout[5][1] + 100
    # A budget of two tensors: the reader cannot run ahead to the cut before w0..w4 are delivered
    # (without one, the error may arrive before tensors that completed, which is allowed).
    cfg = config(concurrency=1, block_size=4096, memory_limit=40 * KiB)
    with streamer.open(path, config=cfg, order="checkpoint") as s:
        os.truncate(path, cut)
        got = {}
        with pytest.raises(ReadError) as info:
            for name, t in s:
                got[name] = t
    assert info.value.tensor == layout[5][0]
    assert list(got) == [n for n, _, _ in layout[:5]]
    for name, t in got.items():
        assert_same(t, tensors[name], name)


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_file_truncated_while_being_read(
    tmp_path: Path, deadline: Any, io_mode: str, concurrency: int
) -> None:
    """Another thread truncates the file as soon as the first tensor arrives, while reads are in
    flight. The memory limit keeps the reader from finishing first (only 8 MiB may be read ahead
    of the consumer), so the error is certain: a ReadError, not a hang, not a crash."""
    deadline(60)
    g = torch.Generator().manual_seed(8)
    tensors = {f"w{i:02d}": random_tensor((256 * KiB,), torch.float32, g) for i in range(64)}  # 64 MiB
    path = write_checkpoint(tmp_path, tensors, index=False).shards[0]
    layout = file_layout(path)
    cut = layout[len(layout) // 2][1] + 12345
    first_arrived = threading.Event()
    truncated = threading.Event()

    def truncate() -> None:
        first_arrived.wait(30)
        os.truncate(path, cut)
        truncated.set()

    worker = threading.Thread(target=truncate)
    worker.start()
    cfg = config(concurrency=concurrency, block_size=4096, memory_limit=8 * MiB, io_mode=io_mode)
    received = []
    try:
        with streamer.open(path, config=cfg) as s, pytest.raises(ReadError) as info:
            for name, tensor in s:
                received.append(name)
                if not first_arrived.is_set():
                    first_arrived.set()
                    assert truncated.wait(30)
                assert_same(tensor, tensors[name], name)  # everything delivered is still right
    finally:
        first_arrived.set()
        worker.join()
    error = info.value
    assert error.path == str(path)
    assert error.tensor in {n for n, _, e in layout if e > cut}
    assert error.offset is not None
    assert len(received) < len(layout)


# --- device and configuration ---------------------------------------------------------------


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1), "meta", "tpu", "nonsense:x"])
def test_unavailable_device(small: Written, device: Any) -> None:
    with pytest.raises(DeviceError):
        streamer.open(small.index, device=device)
    with pytest.raises(DeviceError):
        streamer.load(small.index, device=device)
    with pytest.raises(DeviceError):
        streamer.load_file(small.shards[0], device=device)


@pytest.mark.parametrize(
    "overrides",
    [
        {"concurrency": 0},
        {"concurrency": -1},
        {"concurrency": 100_000},
        {"block_size": 0},
        {"block_size": -4096},
        {"memory_limit": -1},
        {"memory_limit": "lots"},
        {"hugepages": "maybe"},
        {"block_size": "16XB"},
        {"io_mode": "fast"},
    ],
)
def test_bad_config(overrides: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        StreamerConfig(**overrides)
    assert isinstance(info.value, StreamerError) and isinstance(info.value, ValueError)
    assert next(iter(overrides)) in str(info.value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("STREAMER_BLOCK_SIZE", "abc"),
        ("STREAMER_BLOCK_SIZE", "12XB"),
        ("STREAMER_BLOCK_SIZE", "-5"),
        ("STREAMER_CONCURRENCY", "many"),
        ("STREAMER_CONCURRENCY", "0"),
        ("STREAMER_MEMORY_LIMIT", "lots"),
        ("STREAMER_IO_MODE", "fast"),
        ("STREAMER_HUGEPAGES", "maybe"),
    ],
)
def test_bad_environment(small: Written, monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as info:
        StreamerConfig()
    assert variable in str(info.value) or value in str(info.value)
    with pytest.raises(ConfigError):  # the default config of a load reads the environment too
        streamer.load(small.index)
    # An explicit config does not consult the variable that config sets.
    field = {
        "STREAMER_BLOCK_SIZE": "block_size",
        "STREAMER_CONCURRENCY": "concurrency",
        "STREAMER_MEMORY_LIMIT": "memory_limit",
        "STREAMER_IO_MODE": "io_mode",
        "STREAMER_HUGEPAGES": "hugepages",
    }[variable]
    good = {
        "block_size": 4096,
        "concurrency": 2,
        "memory_limit": None,
        "io_mode": "buffered",
        "hugepages": False,
    }
    monkeypatch.delenv(variable)
    cfg = StreamerConfig(**good)
    monkeypatch.setenv(variable, value)
    assert getattr(cfg, field) == good[field]


def test_bad_order_is_a_config_error(small: Written) -> None:
    """Every deliberate error is a StreamerError; an invalid argument is a ConfigError."""
    with pytest.raises(ConfigError):
        streamer.open(small.index, order="random")  # type: ignore[arg-type]


def test_every_error_is_a_streamer_error() -> None:
    for cls in (ConfigError, DeviceError, HeaderError, ReadError, SourceError):
        assert issubclass(cls, StreamerError)
    error = ReadError("boom", path="/x", tensor="t", offset=7)
    assert (error.path, error.tensor, error.offset) == ("/x", "t", 7)
    assert "'/x'" in str(error) and "'t'" in str(error) and "byte 7" in str(error)


# --- misuse of a handle ---------------------------------------------------------------------


def test_resuming_an_iterator_after_close_raises_a_typed_error(small: Written, deadline: Any) -> None:
    deadline(30)
    s = streamer.open(small.index, config=config(concurrency=1, block_size=4096, memory_limit=16 * KiB))
    it = iter(s)
    next(it)
    s.close()
    with pytest.raises(StreamerError):
        next(it)


def test_get_tensor_during_iteration(small: Written, deadline: Any) -> None:
    """Fetching one tensor while iterating (e.g. a bias's weight) must not break the iteration."""
    deadline(30)
    expected = {n: t for n, t in small.tensors.items()}
    got = {}
    with streamer.open(
        small.index, config=config(concurrency=1, block_size=4096, memory_limit=16 * KiB)
    ) as s:
        for name, tensor in s:
            got[name] = tensor
            assert_same(s.get_tensor("t0"), expected["t0"])
    assert set(got) == set(expected)
    for name, tensor in got.items():
        assert_same(tensor, expected[name], name)

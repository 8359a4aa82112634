"""Shared helpers for the loader tests: checkpoint writers, byte-exact comparison, resource counters.

Everything here is independent of streamer's own format layer (headers are parsed with ``json``
directly), so a bug there cannot hide itself from the tests that use these helpers.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from streamer.config import S3Config, StreamerConfig
from streamer.engine import native
from streamer.host.machine import transparent_hugepages

KiB = 1 << 10
MiB = 1 << 20

# safetensors dtype name -> torch dtype, for the hand-built files (kept independent of streamer).
# Only the dtypes this torch has: the oldest torch CI tests (scripts/check_range.sh) lacks F8_E8M0.
TORCH_DTYPE = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64",
        "F32": "float32",
        "F16": "float16",
        "BF16": "bfloat16",
        "I64": "int64",
        "I32": "int32",
        "I16": "int16",
        "I8": "int8",
        "U8": "uint8",
        "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
        "C64": "complex64",
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
    }.items()
    if hasattr(torch, attr)
}


# --- hermetic environment -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_streamer_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build their own configs; a STREAMER_* variable in the caller's shell must not leak in."""
    for name in list(os.environ):
        if name.startswith("STREAMER_"):
            monkeypatch.delenv(name)


def config(**overrides: Any) -> StreamerConfig:
    """A config with small, explicit defaults (tests use small checkpoints), reading every run
    through the engine (a small run would be read inline: ``tests/test_inline.py`` tests that)."""
    values: dict[str, Any] = {
        "concurrency": 4,
        "block_size": 64 * KiB,
        "memory_limit": None,
        "io_mode": "auto",
        "inline_max_bytes": 0,
    }
    values.update(overrides)
    return StreamerConfig(**values)


# --- servers and command lines ---------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """A moto S3 server on a free loopback port (real HTTP); yields its endpoint URL."""
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        srv.stop()


# Request bounds for object-store tests on 127.0.0.1: failing cases end in seconds.
FAST_BOUNDS: dict[str, Any] = {
    "concurrency": 8,
    "max_attempts": 5,
    "retry_deadline": 30.0,
    "connect_timeout": 2.0,
    "read_timeout": 1.0,
    "backoff_base": 0.01,
    "backoff_max": 0.05,
}


def s3_stored(bucket: str, key: str, size: int, version: str | None) -> Any:
    """An S3 object as a header read saw it: how the cache's notes make S3's objects."""
    from streamer.backends.s3.uri import ObjectInfo, S3Uri

    return ObjectInfo(S3Uri(bucket, key), size, version)


def loopback_s3_config(endpoint: str, credentials: tuple[str, str, str], **overrides: Any) -> S3Config:
    """An ``S3Config`` for a test server on 127.0.0.1: path addressing, explicit credentials
    (access key, secret, session token: sentinels the tests look for in errors), and timeouts
    and backoffs small enough that failing cases end in seconds."""
    access_key, secret_key, token = credentials
    values: dict[str, Any] = {
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "addressing_style": "path",
        "access_key_id": access_key,
        "secret_access_key": secret_key,
        "session_token": token,
        **FAST_BOUNDS,
    }
    values.update(overrides)
    return S3Config(**values)


def s3_client(endpoint: str, access_key: str, secret_key: str) -> Any:
    """A boto3 client of the test server, for setting up buckets and objects."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
    )


# Taken at import, before any fixture runs. STREAMER_* knobs must not leak into the CLI runs,
# except the pointer at a developer's build of the native engine.
BENCH_ENV = {
    k: v for k, v in os.environ.items() if not k.startswith("STREAMER_") or k == "STREAMER_NATIVE_LIB"
}


def bench(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m streamer_bench ARGS`` of the installed package (run outside the checkout)."""
    return subprocess.run(
        [sys.executable, "-m", "streamer_bench", *args],
        capture_output=True,
        text=True,
        env=BENCH_ENV | (env or {}),
        timeout=timeout,
        cwd=tempfile.gettempdir(),
    )


def bench_report(out: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A successful ``bench`` run writing ``out/result.json``, ``out/result.png`` and
    ``out/result.prom``: the process (``proc``), the parsed JSON (``json``) and ``out``."""
    files = ("--json", str(out / "result.json"), "--plot", str(out / "result.png"))
    proc = bench(*args, *files, "--prometheus-textfile", str(out / "result.prom"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"proc": proc, "json": json.loads((out / "result.json").read_text()), "out": out}


# --- tensors and comparison -----------------------------------------------------------------


def random_tensor(
    shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaN payloads, infinities, subnormals included)."""
    numel = 1
    for dim in shape:
        numel *= dim
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2  # any other byte is not a valid torch bool
    return raw.view(dtype).reshape(tuple(shape))


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order, for any dtype (0-d, empty, bool, float8, complex)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Same dtype, same shape, same bytes (so NaN payloads and -0.0 count)."""
    where = f" for {name!r}" if name else ""
    assert isinstance(got, torch.Tensor), f"not a tensor{where}: {type(got)}"
    assert got.dtype == expected.dtype, f"dtype{where}: {got.dtype} != {expected.dtype}"
    assert tuple(got.shape) == tuple(expected.shape), (
        f"shape{where}: {tuple(got.shape)} != {tuple(expected.shape)}"
    )
    assert got.device.type == "cpu", f"device{where}: {got.device}"
    assert raw_bytes(got) == raw_bytes(expected), f"bytes differ{where}"


def assert_same_dict(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(expected), (
        f"missing {sorted(set(expected) - set(got))[:5]}, unexpected {sorted(set(got) - set(expected))[:5]}"
    )
    for name, tensor in expected.items():
        assert_same(got[name], tensor, name)


def snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: raw_bytes(t) for name, t in tensors.items()}


# --- files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    """A checkpoint on disk: its shards in order, and the index file when one was written."""

    directory: Path
    shards: tuple[Path, ...]
    index: Path | None
    tensors: dict[str, torch.Tensor]

    @property
    def source(self) -> Path:
        """The index when there is one, else the single file."""
        if self.index is not None:
            return self.index
        assert len(self.shards) == 1
        return self.shards[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def write_checkpoint(
    directory: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    *,
    shards: int = 1,
    index: bool = True,
    metadata: Mapping[str, str] | None = None,
    prefix: str = "model",
) -> Written:
    """Saves ``tensors`` with ``safetensors.torch.save_file`` into ``shards`` files (split in insertion
    order) plus, when ``index``, an HF-style ``<prefix>.safetensors.index.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per_shard = -(-len(names) // shards) if names else 0
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for i in range(shards):
        chunk = names[i * per_shard : (i + 1) * per_shard]
        file_name = (
            f"{prefix}.safetensors" if shards == 1 else f"{prefix}-{i + 1:05d}-of-{shards:05d}.safetensors"
        )
        path = directory / file_name
        safetensors.torch.save_file(
            {n: tensors[n] for n in chunk},
            str(path),
            metadata=dict(metadata) if metadata is not None else None,
        )
        paths.append(path)
        weight_map.update({n: file_name for n in chunk})
    index_path = None
    if index:
        index_path = directory / f"{prefix}.safetensors.index.json"
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return Written(directory, tuple(paths), index_path, dict(tensors))


@dataclass(frozen=True)
class RawEntry:
    name: str
    dtype: str  # safetensors name, e.g. "F32"
    shape: tuple[int, ...]
    data: bytes
    gap: int = 0  # bytes of padding written before this tensor


def write_raw(
    path: str | os.PathLike[str],
    entries: Sequence[RawEntry],
    *,
    metadata: Mapping[str, str] | None = None,
    data_start_mod8: int | None = None,
) -> dict[str, tuple[int, int]]:
    """Writes a safetensors file byte by byte, tensors laid out in the given order with no alignment.

    ``data_start_mod8``: pad the JSON with trailing spaces so that the data section starts at a
    byte offset with this remainder modulo 8 (default: no padding, it starts wherever the JSON
    ends). Returns each tensor's absolute [begin, end) in the file.
    """
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    relative: dict[str, tuple[int, int]] = {}
    for e in entries:
        offset += e.gap
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + len(e.data)],
        }
        relative[e.name] = (offset, offset + len(e.data))
        offset += len(e.data)
    text = json.dumps(header).encode("utf-8")
    if data_start_mod8 is not None:
        text += b" " * ((data_start_mod8 - 8 - len(text)) % 8)
    data_start = 8 + len(text)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for e in entries:
            f.write(b"\0" * e.gap)
            f.write(e.data)
    return {name: (data_start + b, data_start + e) for name, (b, e) in relative.items()}


def raw_entry(
    name: str, dtype: str, shape: Sequence[int], *, gap: int = 0, generator: torch.Generator | None = None
) -> tuple[RawEntry, torch.Tensor]:
    """A random tensor and the RawEntry that writes it."""
    tensor = random_tensor(shape, TORCH_DTYPE[dtype], generator)
    return RawEntry(name, dtype, tuple(shape), raw_bytes(tensor), gap), tensor


def file_layout(path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """(name, absolute begin, absolute end) of every tensor, in streamer's checkpoint order
    (begin, then end, then name: an empty tensor comes before a tensor starting where it
    does), parsed here with ``json`` rather than by streamer."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    rows = [(name, 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for name, v in header.items()]
    return sorted(rows, key=lambda r: (r[1], r[2], r[0]))


def checkpoint_order(shards: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Tensor names in file order, then offset order."""
    return [name for shard in shards for name, _, _ in file_layout(shard)]


def reference_load(shards: Sequence[str | os.PathLike[str]]) -> dict[str, torch.Tensor]:
    """What ``safetensors`` itself reads from the shards."""
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        out.update(safetensors.torch.load_file(str(shard)))
    return out


# --- resources ------------------------------------------------------------------------------


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Ends a server the tests started: terminated, killed if it lingers, always reaped."""
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def thread_count() -> int:
    """Kernel threads of this process (native pthreads included, unlike threading.active_count)."""
    return len(os.listdir("/proc/self/task"))


def settled_thread_count(at_most: int, seconds: float = 10.0) -> int:
    """``thread_count()`` once it is ``at_most`` or ``seconds`` have passed: a joined thread can
    still be listed in /proc/self/task for a moment (pthread_join returns before the kernel
    releases it), which a busy machine stretches."""
    deadline = time.monotonic() + seconds
    while thread_count() > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread_count()


def takes_direct_io(directory: Path) -> bool:
    """Whether the file system under ``directory`` opens files with O_DIRECT (tmpfs does not)."""
    probe = directory / "o_direct_probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


def _fill_works() -> bool:
    fill, _ = native.PageFill.open()
    if fill is None:
        return False
    fill.close()
    return True


needs_fill = pytest.mark.skipif(not _fill_works(), reason="this kernel refuses userfaultfd")
needs_huge_pages = pytest.mark.skipif(not transparent_hugepages(), reason="this kernel has no THP")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_files() -> list[str]:
    """What each descriptor points at (for failure messages)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used is gone
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
    return sorted(out)


def mapping_of(address: int) -> str | None:
    """The /proc/self/maps line whose range holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            span = line.split()[0]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return line.rstrip("\n")
    return None


# --- hang guard -----------------------------------------------------------------------------


class Deadline(Exception):
    """A test ran past its deadline (a hang)."""


@pytest.fixture
def deadline() -> Iterator[Any]:
    """``deadline(seconds)`` arms a guard: SIGALRM raises ``Deadline`` in the main thread (the loader
    waits in 100 ms slices, so Python code runs often enough to see it); if the process is stuck in
    native code instead, faulthandler dumps every thread's stack and exits after twice the time."""
    armed = False

    def arm(seconds: int) -> None:
        nonlocal armed
        armed = True

        def on_alarm(signum: int, frame: Any) -> None:
            raise Deadline(f"still running after {seconds} s: the load hangs")

        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(seconds)
        faulthandler.dump_traceback_later(2 * seconds, exit=True, file=sys.stderr)

    yield arm
    if armed:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        faulthandler.cancel_dump_traceback_later()

"""The page fill: fresh CPU buffers whose pages are created holding their bytes (userfaultfd).

What must hold: every byte exact, whatever the layout; nothing a caller can reach through a tensor
lies in a page not yet filled (a touch of one would wait for ever): its storage is its own bytes;
a kernel or a buffer that refuses leaves the load plain, not failed; only memory of the run's own
goes through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    KiB,
    MiB,
    assert_same_dict,
    config,
    fd_count,
    loopback_s3_config,
    needs_fill,
    needs_huge_pages,
    random_tensor,
    raw_bytes,
    s3_client,
    takes_direct_io,
    write_checkpoint,
)

import streamer
from streamer.config import UNLIMITED, ConfigError, MemoryLimit, StreamerConfig
from streamer.engine import native
from streamer.engine.blocks import Block
from streamer.errors import ReadError
from streamer.plan.segments import plan_segments
from streamer.run.cpu import MAPPED_VIEW_BYTES
from streamer_bench import pagecache

# Buffered: every file read the same way, whatever the page cache kept of a file just written.
FILLING: dict[str, Any] = {"page_fill": True, "io_mode": "buffered"}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Sizes off every page and block boundary, several dtypes, an empty and a 0-d tensor."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    shapes = [(1,), (3, 5), (1023,), (4097,), (300, 301), (70_001,), (0, 4), (), (513, 1025)]
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float16, torch.bool]
    for i, shape in enumerate(shapes * 3):
        tensors[f"t{i:02d}"] = random_tensor(shape, dtypes[i % len(dtypes)], generator)
    return tensors


def _read_whole_storage(tensor: torch.Tensor) -> None:
    """Reads every byte of ``tensor``'s storage, as torch.save does, once it is known to be the
    tensor's own bytes (a storage reaching further could wait for ever on an unfilled page)."""
    storage = tensor.untyped_storage()
    assert (storage.data_ptr(), storage.nbytes()) == (tensor.data_ptr(), tensor.nbytes)
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    int(whole.sum(dtype=torch.int64))


@needs_fill
@pytest.mark.parametrize("shards", [1, 3])
def test_a_load_through_the_page_fill_is_bit_exact_and_says_so(tmp_path: Path, shards: int) -> None:
    written = write_checkpoint(tmp_path, _tensors(shards), shards=shards)
    with streamer.open(written.source, config=config(**FILLING)) as handle:
        got = dict(iter(handle))
        metrics = handle.metrics
    assert_same_dict(got, written.tensors)
    assert metrics["page_fill"] == "on"
    # Whole pages of every buffer: at least the tensor bytes, at most a page more per block.
    assert written.nbytes <= metrics["filled_bytes"] <= written.nbytes + metrics["blocks"] * 2 * 4 * KiB

    with streamer.open(written.source, config=config(page_fill=False)) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        assert (handle.metrics["page_fill"], handle.metrics["filled_bytes"]) == ("", 0)


@needs_fill
def test_cached_pages_stay_mapped_a_block_at_most_and_a_chunk_under_a_memory_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a limit a reader unmaps the file pages it placed from the cache once per block
    (fewer TLB flushes); under a memory_limit the caller set, after every chunk, so that little but
    the limit's buffers is resident. Bit-exact both ways."""
    written = write_checkpoint(tmp_path, _tensors(9), shards=2)
    for path in written.shards:
        path.read_bytes()
    views: list[int] = []
    opened = native.PageFill.open.__func__  # type: ignore[attr-defined]

    def recording_open(
        cls: type[native.PageFill], mapped_view_bytes: int
    ) -> tuple[native.PageFill | None, str]:
        views.append(mapped_view_bytes)
        return opened(cls, mapped_view_bytes=mapped_view_bytes)  # type: ignore[no-any-return]

    monkeypatch.setattr(native.PageFill, "open", classmethod(recording_open))
    for limit in (None, 32 * MiB):
        with streamer.open(written.source, config=config(**FILLING, memory_limit=limit)) as handle:
            assert_same_dict(dict(iter(handle)), written.tensors)
            assert handle.metrics["mapped_bytes"] > 0
    assert views == [MAPPED_VIEW_BYTES, native.FILL_CHUNK]


@needs_fill
def test_cached_pages_are_placed_straight_from_the_cache_and_cold_ones_are_read(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, _tensors(7), shards=2)
    files = sorted(tmp_path.glob("*.safetensors"))
    for path in files:
        path.read_bytes()
    with streamer.open(written.source, config=config(**FILLING)) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        warm = handle.metrics
    # Chunks of whole pages the cache holds come from the file's mapping (the C engine's tests pin
    # how many); a file's last page is read.
    assert 0 < warm["mapped_bytes"] <= warm["filled_bytes"]
    maps = Path("/proc/self/maps").read_text()
    assert not any(str(path) in maps for path in files)  # the engine's mappings went with it

    still_cached = pagecache.evict_and_verify(files)  # a tmpfs keeps its pages
    with streamer.open(written.source, config=config(**FILLING)) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        cold = handle.metrics
    assert cold["filled_bytes"] == warm["filled_bytes"]
    if still_cached == 0:
        # A file's first chunk is read (the reads' own readahead may bring the chunks after it).
        assert cold["mapped_bytes"] <= cold["filled_bytes"] - len(files) * 4 * KiB


@needs_fill
def test_under_an_address_space_limit_files_are_read_not_mapped(tmp_path: Path) -> None:
    """A mapping spends address space the buffers need as well: under ``ulimit -v`` the fill reads."""
    written = write_checkpoint(tmp_path, _tensors(9))
    script = textwrap.dedent(
        f"""
        import json, resource
        import streamer
        resource.setrlimit(resource.RLIMIT_AS, (1 << 40, resource.RLIM_INFINITY))
        config = streamer.StreamerConfig(page_fill=True, io_mode="buffered", inline_max_bytes=0)
        with streamer.open({str(written.source)!r}, config=config) as handle:
            dict(iter(handle))
            print(json.dumps([handle.metrics["filled_bytes"], handle.metrics["mapped_bytes"]]))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    filled, mapped = json.loads(done.stdout.splitlines()[-1])
    assert (filled > 0, mapped) == (True, 0)


@needs_fill
def test_a_cached_file_cut_short_during_a_load_never_hands_out_its_lost_bytes(tmp_path: Path) -> None:
    """Cut inside a page after the first tensor: the file's mapping still shows that page, zeros
    past the new end. Every tensor handed out is exact; the load ends exact (the engine read all
    before the cut) or with a ReadError naming the file. The C engine's tests pin the exact case."""
    tensors = {f"t{i:03d}": torch.arange(i << 16, (i + 1) << 16, dtype=torch.int32) for i in range(128)}
    written = write_checkpoint(tmp_path, tensors)
    path = next(tmp_path.glob("*.safetensors"))
    path.read_bytes()
    one_reader = config(**FILLING, concurrency=1, memory_limit=UNLIMITED)
    with streamer.open(written.source, config=one_reader) as handle:
        stream = iter(handle)
        name, tensor = next(stream)
        os.truncate(path, path.stat().st_size // 2 + 1001)
        got = {name: tensor}
        try:
            for name, tensor in stream:
                got[name] = tensor
        except ReadError as error:
            assert str(path) in str(error)
            assert len(got) < len(tensors)
    for name, tensor in got.items():
        assert torch.equal(tensor, tensors[name]), name


@needs_fill
@pytest.mark.parametrize("memory_limit", [UNLIMITED, 512 * KiB])
def test_a_tensor_handed_out_reaches_only_its_own_filled_bytes(
    tmp_path: Path, memory_limit: MemoryLimit
) -> None:
    """A tensor comes out once its own bytes are read, while its buffer may still be filling, so
    its storage must be exactly its bytes: reading all of it (what torch.save does) then cannot
    wait on a page. Unlimited, a file is one buffer read by many blocks; under a limit, buffers
    are small and some are reused (read plainly)."""
    tensors = _tensors(7)
    tensors.update({f"big{i}": torch.full((300_000,), i, dtype=torch.int32) for i in range(8)})
    written = write_checkpoint(tmp_path, tensors, shards=2)
    cfg = config(**FILLING, memory_limit=memory_limit, block_size=64 * KiB, concurrency=2)
    seen = {}
    with streamer.open(written.source, config=cfg) as handle:
        for name, tensor in handle:
            if tensor.numel():
                _read_whole_storage(tensor)
            seen[name] = tensor.clone()
        assert handle.metrics["filled_bytes"] > 0
        if memory_limit != UNLIMITED:
            assert handle.metrics["buffers_reused"] > 0
    assert_same_dict(seen, written.tensors)


@needs_fill
def test_touching_the_whole_storage_while_streaming_never_hangs(tmp_path: Path) -> None:
    """The same in a process of its own, under a timeout. A touched page that is not filled yet
    waits for its reader; if that read then fails (the file is cut short here, after the first
    tensor), it would wait for ever, which no in-process guard can interrupt. One reader and
    small blocks keep most of the file unread when it is cut."""
    tensors = {f"w{i}": torch.full((250_000,), i, dtype=torch.int32) for i in range(96)}
    written = write_checkpoint(tmp_path, tensors, index=False)
    path = written.shards[0]
    script = textwrap.dedent(
        f"""
        import os, streamer, torch
        from streamer.errors import ReadError
        cfg = streamer.StreamerConfig(page_fill=True, io_mode="buffered", concurrency=1, block_size=64 * 1024)
        with streamer.open({str(path)!r}, config=cfg) as handle:
            try:
                for name, tensor in handle:
                    os.truncate({str(path)!r}, 4 << 20)
                    whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
                    assert int(whole.sum(dtype=torch.int64)) >= 0 and whole.numel() >= tensor.numel() * 4
            except ReadError:
                pass  # the reader met the cut before the end: what it had not read is an error
            assert handle.metrics["page_fill"] == "on", handle.metrics["page_fill"]
        print("done")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr


@needs_fill
def test_a_file_cut_short_during_a_filled_load_is_a_named_error_and_leaks_nothing(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, {"a": torch.arange(600_000, dtype=torch.float32)}, index=False)
    path = written.shards[0]
    fds = fd_count()
    with streamer.open(path, config=config(**FILLING)) as handle:
        os.truncate(path, path.stat().st_size - 1_000_000)
        with pytest.raises(ReadError) as raised:
            dict(iter(handle))
    assert str(path) in str(raised.value) and "'a'" in str(raised.value)
    assert fd_count() == fds


@needs_fill
def test_a_load_given_up_early_closes_its_page_fill(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, _tensors(3), shards=2)
    fds = fd_count()
    for _ in range(3):
        with streamer.open(written.source, config=config(**FILLING, memory_limit=256 * KiB)) as handle:
            next(iter(handle))
    assert fd_count() == fds


@needs_fill
@needs_huge_pages
@pytest.mark.parametrize("block_size", [64 * KiB, 12 * MiB])
def test_files_read_with_o_direct_go_through_it(tmp_path: Path, block_size: int) -> None:
    """A cold read lands in the reader's own huge-page buffer (large requests) and its pages are
    placed from there: none is faulted in, by the reader or ahead of it. Blocks longer than the
    reader's buffer are read a piece at a time."""
    if not takes_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} does not open files with O_DIRECT (tmpfs)")
    tensors = {**_tensors(8), "big": random_tensor((5 * MiB + 3,), torch.float32)}
    written = write_checkpoint(tmp_path, tensors, shards=2)
    cfg = config(page_fill=True, io_mode="direct", block_size=block_size, inline_max_bytes=0)
    with streamer.open(written.source, config=cfg) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        metrics = handle.metrics
    assert metrics["direct_files"] == 2 and metrics["page_fill"] == "on", metrics
    assert metrics["filled_bytes"] >= sum(t.nbytes for t in tensors.values()), metrics
    assert metrics["prefault_bytes"] == 0, metrics


@needs_fill
@needs_huge_pages
def test_o_direct_reads_under_a_memory_limit_keep_to_it(tmp_path: Path) -> None:
    """The readers' 8 MiB buffers are outside the memory budget: under a limit the caller set, an
    O_DIRECT run faults its buffers in ahead instead of filling them, bit-exact all the same."""
    if not takes_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} does not open files with O_DIRECT (tmpfs)")
    tensors = {**_tensors(8), "big": random_tensor((5 * MiB + 3,), torch.float32)}
    written = write_checkpoint(tmp_path, tensors, shards=2)
    cfg = config(page_fill=True, io_mode="direct", memory_limit=32 * MiB, inline_max_bytes=0)
    with streamer.open(written.source, config=cfg) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        metrics = handle.metrics
    assert metrics["direct_files"] == 2 and metrics["filled_bytes"] == 0, metrics
    assert metrics["prefault_bytes"] >= sum(t.nbytes for t in tensors.values()), metrics


@needs_fill
@needs_huge_pages
def test_o_direct_fills_under_an_automatic_budget_charge_the_readers_buffers(tmp_path: Path) -> None:
    """The readers' 8 MiB buffers that O_DIRECT blocks are filled through live as long as the run:
    an automatic budget counts them; an unlimited load has no budget to charge."""
    if not takes_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} does not open files with O_DIRECT (tmpfs)")
    written = write_checkpoint(tmp_path, _tensors(10), shards=2)
    readers = 3
    bounce = readers * native.FILL_DIRECT_CHUNK
    assert written.nbytes < bounce // 2  # the tensors' buffers alone never reach the charge
    for limit in (None, UNLIMITED):
        cfg = config(page_fill=True, io_mode="direct", memory_limit=limit, concurrency=readers)
        with streamer.open(written.source, config=cfg) as handle:
            assert_same_dict(dict(iter(handle)), written.tensors)
            metrics = handle.metrics
        assert metrics["direct_files"] == 2 and metrics["filled_bytes"] >= written.nbytes, metrics
        assert metrics["memory_limit_source"].startswith("auto" if limit is None else "unlimited"), metrics
        assert (metrics["peak_buffer_bytes"] >= bounce) is (limit is None), metrics


@needs_fill
@needs_huge_pages
@pytest.mark.parametrize("cut_at", ["inside a chunk", "at a chunk's end"])
def test_a_file_cut_short_during_an_o_direct_fill_names_it_and_hands_out_only_exact_tensors(
    tmp_path: Path, cut_at: str
) -> None:
    """Truncated after open, read cold in 12 MiB blocks (two of the readers' 8 MiB chunks each):
    a ReadError naming the file, each tensor handed out before it exact, nothing left open."""
    if not takes_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} does not open files with O_DIRECT (tmpfs)")
    tensors = {f"t{i}": torch.arange(i << 20, (i + 1) << 20, dtype=torch.int32) for i in range(8)}  # 32 MiB
    written = write_checkpoint(tmp_path, tensors, index=False)
    (path,) = written.shards
    cut = 20 * MiB + (12345 if cut_at == "inside a chunk" else 0)
    fds, threads = fd_count(), threading.active_count()
    cfg = config(page_fill=True, io_mode="direct", block_size=12 * MiB, memory_limit=UNLIMITED)
    got: dict[str, torch.Tensor] = {}
    with streamer.open(path, config=cfg, order="checkpoint") as handle:
        os.truncate(path, cut)
        with pytest.raises(ReadError) as info:
            for name, tensor in handle:
                got[name] = tensor
    assert info.value.path == str(path) and str(path) in str(info.value), info.value
    assert len(got) < len(tensors)
    for name, tensor in got.items():
        assert torch.equal(tensor, tensors[name]), name
    assert fd_count() == fds and threading.active_count() <= threads


@pytest.mark.parametrize("without", ["off", "refused", "no huge pages"])
def test_o_direct_reads_without_it_are_faulted_in_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, without: str
) -> None:
    """Turned off, refused by the kernel, or where the readers' buffers cannot take huge pages (an
    O_DIRECT read into scattered 4 KiB pages goes out as small requests): another thread faults the
    fresh pages in ahead of the O_DIRECT reads, which otherwise would fault them in while the
    device waits."""
    if not takes_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} does not open files with O_DIRECT (tmpfs)")
    if without == "refused":
        refuse = classmethod(lambda cls, **_: (None, "userfaultfd refused"))
        monkeypatch.setattr(native.PageFill, "open", refuse)
    if without == "no huge pages":
        monkeypatch.setattr("streamer.run.cpu.transparent_hugepages_kept", lambda: False)
    written = write_checkpoint(tmp_path, _tensors(10), shards=2)
    cfg = config(page_fill=without != "off", io_mode="direct", block_size=64 * KiB, inline_max_bytes=0)
    with streamer.open(written.source, config=cfg) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        metrics = handle.metrics
    assert metrics["direct_files"] == 2 and metrics["filled_bytes"] == 0, metrics
    assert metrics["prefault_bytes"] >= sum(t.nbytes for t in written.tensors.values()), metrics


_SECCOMP_DENY_USERFAULTFD = """
import ctypes, errno, struct
# A seccomp filter, as container runtimes install, that refuses userfaultfd (x86_64: 323) with EPERM.
LD_ABS, JEQ, RET = 0x20, 0x15, 0x06
code = [(LD_ABS, 0, 0, 4), (JEQ, 0, 3, 0xC000003E), (LD_ABS, 0, 0, 0), (JEQ, 0, 1, 323),
        (RET, 0, 0, 0x00050000 | errno.EPERM), (RET, 0, 0, 0x7FFF0000)]
program = b"".join(struct.pack("HBBI", *instruction) for instruction in code)
buffer = ctypes.create_string_buffer(program)

class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
fprog = Program(len(code), ctypes.addressof(buffer))
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the filter names x86_64's syscall number")
def test_a_seccomp_filter_that_refuses_userfaultfd_leaves_the_load_plain(tmp_path: Path) -> None:
    """A real refusal, in a process of its own: the load is exact and says why it ran without the fill."""
    written = write_checkpoint(tmp_path, _tensors(9))
    expected = {name: raw_bytes(tensor).hex() for name, tensor in written.tensors.items()}
    script = _SECCOMP_DENY_USERFAULTFD + textwrap.dedent(
        f"""
        import json, streamer, torch
        cfg = streamer.StreamerConfig(
            page_fill=True, io_mode="buffered", block_size=64 * 1024, inline_max_bytes=0
        )
        with streamer.open({str(written.source)!r}, config=cfg) as handle:
            got = {{name: tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes().hex()
                   for name, tensor in handle}}
            print(json.dumps([handle.metrics["page_fill"], handle.metrics["filled_bytes"], got]))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    page_fill, filled, got = json.loads(result.stdout)
    assert (page_fill, filled) == ("userfaultfd refused: Operation not permitted", 0)
    assert got == expected


def test_a_kernel_that_refuses_leaves_the_load_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Containers often forbid userfaultfd (seccomp: EPERM): the load goes on without it and says why."""
    written = write_checkpoint(tmp_path, _tensors(4))
    refused = "userfaultfd refused: Operation not permitted"
    monkeypatch.setattr(native.PageFill, "open", classmethod(lambda cls, **_: (None, refused)))
    with streamer.open(written.source, config=config(**FILLING)) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        assert handle.metrics["page_fill"] == refused
        assert handle.metrics["filled_bytes"] == 0


@needs_fill
def test_a_buffer_the_kernel_will_not_register_is_read_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = write_checkpoint(tmp_path, _tensors(5))
    monkeypatch.setattr(native.PageFill, "register", lambda self, address, size: False)
    with streamer.open(written.source, config=config(**FILLING)) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        assert handle.metrics["page_fill"] == "on" and handle.metrics["filled_bytes"] == 0


def test_only_the_engine_readers_memory_goes_through_it(s3_server: str, tmp_path: Path) -> None:
    """An S3 load writes its bytes from the event loop (user space): never through the page fill."""
    written = write_checkpoint(tmp_path, _tensors(6), index=False)
    credentials = ("AKIDFILL", "fill-secret", "fill-token")
    client = s3_client(s3_server, credentials[0], credentials[1])
    client.create_bucket(Bucket="fill")
    client.upload_file(str(written.shards[0]), "fill", "model.safetensors")
    cfg = StreamerConfig(**FILLING, block_size=64 * KiB, s3=loopback_s3_config(s3_server, credentials))
    with streamer.open("s3://fill/model.safetensors", config=cfg) as handle:
        assert_same_dict(dict(iter(handle)), written.tensors)
        assert (handle.metrics["page_fill"], handle.metrics["filled_bytes"]) == ("", 0)


@pytest.mark.parametrize(
    ("page_fill", "hugepages", "fills"),
    [(None, False, True), (None, True, False), (True, True, True), (False, False, False)],
)
def test_it_is_on_where_buffers_take_4_kib_pages(
    page_fill: bool | None, hugepages: bool, fills: bool
) -> None:
    assert StreamerConfig(page_fill=page_fill, hugepages=hugepages).fills_pages() is fills


def test_the_environment_decides_when_the_user_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMER_PAGE_FILL", "0")
    assert StreamerConfig(hugepages=False).fills_pages() is False
    monkeypatch.setenv("STREAMER_PAGE_FILL", "1")
    assert StreamerConfig(hugepages=True).fills_pages() is True
    assert StreamerConfig(page_fill=False).fills_pages() is False
    monkeypatch.setenv("STREAMER_PAGE_FILL", "maybe")
    with pytest.raises(ConfigError, match="STREAMER_PAGE_FILL"):
        StreamerConfig()


def test_only_segments_read_in_whole_pages_qualify() -> None:
    units = [native.Unit(0, 100, 70_000), native.Unit(0, 70_000, 200_001)]
    (whole,) = plan_segments(units, block_size=64 * KiB, segment_bytes=None, alignment=4096)
    assert whole.filled_extent(4096) == (0, 200_704)  # [0, 200_001) rounded out to pages
    (odd,) = plan_segments(units, block_size=50_000, segment_bytes=None, alignment=4096)
    assert odd.filled_extent(4096) is None  # blocks end off the page grid
    apart = [native.Unit(0, 0, 4096), native.Unit(0, 5 * MiB, 5 * MiB + 10)]
    (gapped,) = plan_segments(
        apart, block_size=64 * KiB, segment_bytes=None, alignment=4096, request_bytes=MiB
    )
    assert gapped.filled_extent(4096) is None  # pages between the reads would stay unfilled
    assert Block(0, 0, 0, 0, 1, 0, 4096, 0).flags == 0

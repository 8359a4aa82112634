"""Small runs of local files read on the caller's thread (``streamer.run.inline``): bit-exact as
the engine is, each tensor in memory of its own, no reader thread started, the same typed errors,
and the engine again wherever a run is larger, limited or asks for O_DIRECT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import (
    TORCH_DTYPE,
    assert_same_dict,
    random_tensor,
    raw_entry,
    reference_load,
    settled_thread_count,
    thread_count,
    write_checkpoint,
    write_raw,
)

import streamer
from streamer import ReadError, StreamerConfig
from streamer.engine import native
from streamer.host import openmp


@pytest.fixture
def every_dtype(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    tensors = {f"{name}.{i}": random_tensor(shape, dtype, g) for name, dtype in TORCH_DTYPE.items()
               for i, shape in enumerate([(), (0, 3), (7,), (5, 33)])}  # fmt: skip
    return write_checkpoint(tmp_path, tensors, shards=2).directory


def test_a_small_run_is_bit_exact_for_every_dtype_and_starts_no_thread(every_dtype: Path) -> None:
    shards = sorted(every_dtype.glob("*.safetensors"))
    expected = reference_load(shards)
    before = thread_count()
    seen: list[int] = []
    with streamer.open(every_dtype) as handle:
        got = {}
        for name, tensor in handle:
            got[name] = tensor
            seen.append(threading.active_count())
        metrics = handle.metrics
    assert_same_dict(got, expected)
    assert thread_count() == before and max(seen) == threading.active_count()
    assert metrics["readers"] == 0 and metrics["bytes_read"] == metrics["bytes"] > 0
    assert_same_dict(streamer.load(every_dtype), expected)
    assert_same_dict(streamer.load_file(shards[0]), safetensors.torch.load_file(shards[0]))


def test_each_tensor_owns_its_memory(every_dtype: Path) -> None:
    loaded = streamer.load(every_dtype)
    for name, tensor in loaded.items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
    pointers = [t.data_ptr() for t in loaded.values() if t.numel()]
    assert len(set(pointers)) == len(pointers)


def test_unaligned_data_subsets_and_get_tensor(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(8)
    entries, tensors = [], {}
    for i, dtype in enumerate(["F64", "I32", "BF16", "C64", "U8", "F32", "BOOL"]):
        entry, tensor = raw_entry(f"t{i}", dtype, (100 + i, 3), generator=g)  # odd sizes: odd offsets
        entries.append(entry)
        tensors[entry.name] = tensor
    path = tmp_path / "odd.safetensors"
    write_raw(path, entries, data_start_mod8=3)
    assert_same_dict(streamer.load_file(path), tensors)
    with streamer.safe_open(path, "pt") as opened:
        for name in ("t3", "t0", "t6"):
            assert_same_dict({name: opened.get_tensor(name)}, {name: tensors[name]})
    dest = {name: torch.zeros_like(t) for name, t in tensors.items() if name in ("t1", "t4")}
    streamer.load_into(dest, path, strict=False)
    assert_same_dict(dest, {name: tensors[name] for name in dest})


@pytest.mark.parametrize("where", ["mid_tensor", "last_byte", "everything"])
def test_a_file_truncated_after_open_is_a_read_error_naming_file_and_tensor(
    tmp_path: Path, where: str
) -> None:
    g = torch.Generator().manual_seed(4)
    tensors = {f"w{i}": random_tensor((1000,), torch.float32, g) for i in range(8)}
    path = write_checkpoint(tmp_path, tensors, index=False).shards[0]
    size = path.stat().st_size
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with streamer.open(path) as handle:
        cut = {"mid_tensor": size - 6000, "last_byte": size - 1, "everything": 100}[where]
        os.truncate(path, cut)
        handed: list[str] = []
        with pytest.raises(ReadError, match="file ended early") as info:
            handed.extend(name for name, _ in handle)
    assert info.value.path == str(path) and handed == []
    assert info.value.offset == max(cut, data_start)  # where the file came up short
    assert info.value.tensor in tensors


def test_a_missing_or_unreadable_file_after_open_is_typed(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, {"a": torch.ones(3)}, index=False)
    with streamer.open(written.shards[0]) as handle:
        written.shards[0].unlink()
        with pytest.raises(streamer.SourceError, match="cannot open") as info:
            list(handle)
    assert info.value.path == str(written.shards[0])


def test_the_engine_reads_runs_that_are_larger_limited_or_direct(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, {f"w{i}": torch.ones(64 << 10) for i in range(4)}, index=False)
    source = written.shards[0]  # 1 MiB of tensors
    for config, inline in [
        (StreamerConfig(), True),
        (StreamerConfig(inline_max_bytes="512KiB"), False),
        (StreamerConfig(inline_max_bytes=0), False),
        (StreamerConfig(memory_limit="512KiB"), False),  # a streaming limit below the run
        (StreamerConfig(io_mode="direct"), False),
    ]:
        with streamer.open(source, config=config) as handle:
            for name, tensor in handle:  # each dropped: within any limit
                assert_same_dict({name: tensor}, {name: written.tensors[name]})
            assert (handle.metrics["readers"] == 0) == inline, config
    with streamer.open(source, config=StreamerConfig(memory_limit="512KiB")) as handle:
        assert handle.get_tensor("w1").sum() == 64 << 10  # one tensor fits the limit: inline
        assert handle.metrics["readers"] == 0


def test_inline_max_bytes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert StreamerConfig().inline_max_bytes == 64 << 20
    monkeypatch.setenv("STREAMER_INLINE_MAX_BYTES", "0")
    assert StreamerConfig().inline_max_bytes == 0
    monkeypatch.setenv("STREAMER_INLINE_MAX_BYTES", "4MiB")
    assert StreamerConfig().inline_max_bytes == 4 << 20


@pytest.fixture
def shared_run(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A file of 12 MiB: a run that torch's intra-op threads share."""
    g = torch.Generator().manual_seed(6)
    tensors = {f"w{i}": random_tensor((3 << 18,), torch.float32, g) for i in range(4)}
    tensors |= {f"b{i}": random_tensor((1000 + i,), torch.bfloat16, g) for i in range(3)}
    return write_checkpoint(tmp_path, tensors, index=False).shards[0], tensors


@pytest.mark.parametrize("team", ["torch's OpenMP team", "threads of its own"])
def test_a_shared_run_is_bit_exact_leaves_no_thread_and_raises_the_first_failure(
    shared_run: tuple[Path, dict[str, torch.Tensor]], team: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, tensors = shared_run
    if team == "threads of its own":
        monkeypatch.setattr(openmp, "team_entry", lambda: None)
    else:  # this machine's torch runs on OpenMP: its team is found, and woken by an operator first
        assert "OpenMP" in torch.__config__.parallel_info() and openmp.team_entry() is not None
        torch.ones(1 << 22).sum()
    assert openmp.team_threads() == torch.get_num_threads()
    teams: list[int | None] = []
    read_pieces = native.read_pieces

    def recorded(*args: Any) -> Any:
        teams.append(args[3])
        return read_pieces(*args)

    monkeypatch.setattr(native, "read_pieces", recorded)
    before = thread_count()
    for _ in range(3):
        with streamer.open(path) as handle:
            assert_same_dict(dict(iter(handle)), tensors)  # one pass: one run
            assert handle.metrics["readers"] == 0
    assert teams == [openmp.team_entry()] * 3 and (teams[0] is None) == (team == "threads of its own")
    assert settled_thread_count(before) == before  # threads of its own are joined; a team stays torch's
    with streamer.open(path) as handle:
        os.truncate(path, path.stat().st_size - (1 << 20))  # the last float tensor is cut
        with pytest.raises(ReadError, match="file ended early") as info:
            list(handle)
    assert info.value.tensor == "w3" and info.value.path == str(path)
    assert settled_thread_count(before) == before


def test_a_process_whose_torch_has_no_team_yet_is_left_without_one(
    shared_run: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Before torch's first parallel operator its OpenMP team does not exist, and a team call would
    start threads that stay for the life of the process: a load then reads on threads of its own,
    and the process has as many threads after it as before. Once torch has made its team, loads
    use it (still without adding a thread)."""
    path, _ = shared_run
    code = f"""
        import os, torch, streamer
        from streamer.engine import native
        from streamer.host import openmp
        teams = []
        read_pieces = native.read_pieces
        native.read_pieces = lambda *a: teams.append(a[3]) or read_pieces(*a)
        before = len(os.listdir("/proc/self/task"))
        streamer.load_file({str(path)!r})
        alone = len(os.listdir("/proc/self/task"))
        torch.ones(1 << 22).sum()  # torch's first parallel operator: its team now runs
        warmed = len(os.listdir("/proc/self/task"))
        streamer.load_file({str(path)!r})
        print(before, alone, warmed, len(os.listdir("/proc/self/task")), teams == [None, openmp.team_entry()])
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, alone, warmed, after, teams = done.stdout.split()
    assert before == alone and warmed == after and teams == "True", done.stdout
    assert int(warmed) == int(before) + torch.get_num_threads() - 1  # torch's team, not ours


def test_a_child_forked_after_a_team_read_reads_on_threads_of_its_own(
    shared_run: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """GNU OpenMP's pool does not survive a fork: a team call in the child would wait forever for
    the parent's threads (as torch's own parallel operators do there: the child compares bytes
    without them). The child must load all the same, without the team."""
    path, tensors = shared_run
    assert_same_dict(streamer.load_file(path), tensors)  # the parent's team is up
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if it loaded every byte without the team
        try:
            loaded = streamer.load_file(path)
            same = loaded.keys() == tensors.keys()
            same = same and all(_bytes(loaded[k]) == _bytes(tensors[k]) for k in tensors)
            os._exit(0 if same and openmp.team_entry() is None else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung loading a shared run")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_the_openmp_runtime_is_told_apart_by_its_file() -> None:
    torch_dir = Path("/venv/lib/python3.11/site-packages/torch")
    line = "7f3a1c000000-7f3a1c020000 r-xp 00002000 fd:01 1234  {}"
    maps = "\n".join(
        line.format(path)
        for path in (
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
            f"{torch_dir}/lib/libgomp-a34b3233.so.1",
            f"{torch_dir}/lib/libgomp-a34b3233.so.1",
            "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0",
            "/opt/numpy.libs/libgompx.so",
        )
    )
    assert openmp.runtime_path(maps, torch_dir) == f"{torch_dir}/lib/libgomp-a34b3233.so.1"
    assert openmp.runtime_path(maps, Path("/elsewhere")) is None  # two runtimes, neither torch's
    only = line.format("/opt/intel/lib/libiomp5.so")
    assert openmp.runtime_path(only, Path("/elsewhere")) == "/opt/intel/lib/libiomp5.so"
    assert openmp.runtime_path(line.format("/usr/lib/libc.so.6"), torch_dir) is None


def _bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's bytes, taken without a parallel operator."""
    return bytes(tensor.view(torch.uint8).numpy().data)

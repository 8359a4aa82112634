"""How many reader threads a load uses: the user's ``concurrency``, else derived from the machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from copy_standin import StandIn

import streamer
from streamer.config import StreamerConfig
from streamer.host.machine import (
    MAX_READERS,
    MIN_READERS,
    STAGED_READERS,
    cgroup_cpu_quota,
    default_readers,
    usable_cores,
)


@pytest.mark.parametrize(
    ("cores", "expected"), [(1, 8), (2, 8), (8, 8), (12, 12), (16, 16), (64, 16), (256, 16)]
)
def test_loads_into_cpu_memory_use_the_cores_within_8_to_16(cores: int, expected: int) -> None:
    assert (MIN_READERS, MAX_READERS) == (8, 16)
    assert default_readers(cores=cores) == expected


def test_staged_loads_keep_8_readers() -> None:
    assert StreamerConfig(concurrency=None).for_staged().readers() == STAGED_READERS == 8


def _cgroup_v2(root: Path, own: str, limits: dict[str, str]) -> Path:
    """A cgroup v2 tree under ``root`` with ``cpu.max`` files, and a /proc/self/cgroup naming ``own``."""
    for cgroup, limit in limits.items():
        directory = root / cgroup.lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.max").write_text(f"{limit}\n")
    self_cgroup = root / "self-cgroup"
    self_cgroup.write_text(f"0::{own}\n")
    return self_cgroup


def test_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    self_cgroup = _cgroup_v2(
        tmp_path,
        "/kubepods/pod1/ctr",
        {"/kubepods": "max 100000", "/kubepods/pod1": "250000 100000", "/kubepods/pod1/ctr": "max 100000"},
    )
    assert cgroup_cpu_quota(str(tmp_path), str(self_cgroup)) == 2.5
    # 2.5 CPUs of time keep 3 threads busy at most.
    assert usable_cores(str(tmp_path), str(self_cgroup)) == min(3, len(os.sched_getaffinity(0)))


def test_cgroup_v2_unlimited_and_namespaced(tmp_path: Path) -> None:
    # A container with its own cgroup namespace sees itself as the root.
    assert cgroup_cpu_quota(str(tmp_path), str(_cgroup_v2(tmp_path, "/", {"/": "max 100000"}))) is None
    assert cgroup_cpu_quota(str(tmp_path), str(_cgroup_v2(tmp_path, "/", {"/": "50000 100000"}))) == 0.5
    assert usable_cores(str(tmp_path), str(tmp_path / "self-cgroup")) == 1  # never 0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    (cpu / "cpu.cfs_quota_us").write_text("-1\n")
    missing = str(tmp_path / "no-self-cgroup")
    assert cgroup_cpu_quota(str(tmp_path), missing) is None
    (cpu / "cpu.cfs_quota_us").write_text("400000\n")
    assert cgroup_cpu_quota(str(tmp_path), missing) == 4.0


@pytest.mark.parametrize("content", ["", "garbage\n", "max\n", "0 100000\n", "100000 0\n", "x y\n"])
def test_unreadable_cgroup_files_mean_no_quota(tmp_path: Path, content: str) -> None:
    (tmp_path / "cpu.max").write_text(content)
    (tmp_path / "self-cgroup").write_text("0::/\n")
    assert cgroup_cpu_quota(str(tmp_path), str(tmp_path / "self-cgroup")) is None
    assert cgroup_cpu_quota(str(tmp_path / "absent"), str(tmp_path / "absent")) is None


def test_the_environment_or_the_user_overrides_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMER_CONCURRENCY", raising=False)
    auto = StreamerConfig()
    assert auto.concurrency is None
    assert auto.readers() == default_readers(cores=usable_cores())
    assert auto.for_staged().readers() == STAGED_READERS
    explicit = StreamerConfig(concurrency=3)
    assert explicit.readers() == 3 and explicit.for_staged() is explicit
    monkeypatch.setenv("STREAMER_CONCURRENCY", "5")
    assert StreamerConfig().readers() == 5 == StreamerConfig().for_staged().readers()


def test_affinity_limits_the_readers() -> None:
    """One allowed CPU: still 8 readers, the floor (cold reads need the queue depth)."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
        "from streamer.config import StreamerConfig, usable_cores; "
        "print(usable_cores(), StreamerConfig(concurrency=None).readers())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.split() == ["1", "8"]


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {f"layer.{i}": torch.randn(256, 1024 + i) for i in range(6)}
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, path)
    return path, tensors


def test_a_load_reports_the_readers_it_ran(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, tensors = checkpoint
    monkeypatch.delenv("STREAMER_CONCURRENCY", raising=False)
    block = 64 << 10  # ~100 blocks: more than any reader count
    with streamer.open(
        path, config=StreamerConfig(block_size=block, inline_max_bytes=0)
    ) as handle:  # into CPU memory
        loaded = dict(iter(handle))
        assert handle.metrics["readers"] == StreamerConfig().readers()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor)
    with streamer.open(
        path, config=StreamerConfig(concurrency=3, block_size=block, inline_max_bytes=0)
    ) as handle:
        dict(iter(handle))
        assert handle.metrics["readers"] == 3


def test_a_run_starts_no_more_readers_than_it_has_blocks(
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, tensors = checkpoint
    with streamer.open(
        path, config=StreamerConfig(concurrency=8, block_size=8 << 20, inline_max_bytes=0)
    ) as handle:
        # 1 MiB under 8 MiB blocks: at most 2 (a span may straddle the block grid).
        assert torch.equal(handle.get_tensor("layer.3"), tensors["layer.3"])
        assert handle.metrics["readers"] == 2
    with streamer.open(
        path, config=StreamerConfig(concurrency=16, block_size=256 << 10, inline_max_bytes=0)
    ) as handle:
        assert torch.equal(handle.get_tensor("layer.3"), tensors["layer.3"])  # 4 blocks, +2
        assert handle.metrics["readers"] == 6
    big = torch.randn(16 << 20)  # 64 MiB, one tensor: one unit of many blocks
    path_big = path.with_name("big.safetensors")
    safetensors.torch.save_file({"big": big}, path_big)
    with streamer.open(
        path_big, config=StreamerConfig(concurrency=8, block_size=1 << 20, inline_max_bytes=0)
    ) as handle:
        assert torch.equal(handle.get_tensor("big"), big)
        assert handle.metrics["readers"] == 8


def test_staged_loads_run_8_readers_unless_told(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU load's readers, on the CPU: the stand-in copy engine takes the GPU's place."""
    path, tensors = checkpoint
    monkeypatch.delenv("STREAMER_CONCURRENCY", raising=False)
    standin = StandIn(monkeypatch)
    block = 4096
    for concurrency, readers in ((None, STAGED_READERS), (5, 5)):
        config = StreamerConfig(concurrency=concurrency, block_size=block)
        with streamer.open(path, config=config) as handle:
            loaded = dict(handle)
            metrics = handle.metrics
        assert metrics["readers"] == readers
        assert metrics["peak_buffer_bytes"] == 2 * readers * block  # the ring: two rounds of reads
        for name, tensor in tensors.items():
            assert torch.equal(loaded[name], tensor)
    standin.assert_clean()

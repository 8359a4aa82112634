"""Huge pages by default where the kernel has them, for large buffers only.

What the kernel does with the advice is checked in ``/proc/self/smaps`` (``THPeligible``), which
says whether a mapping may get huge pages; whether it does at a given moment depends on free
memory (a busy machine may fall back to 4 KiB pages), so no test counts page faults.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

import streamer
from streamer import config as config_module
from streamer.config import StreamerConfig
from streamer.engine import native


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("always [madvise] never\n", True),
        ("[always] madvise never\n", True),
        ("always madvise [never]\n", False),
    ],
)
def test_default_follows_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, expected: bool
) -> None:
    enabled = tmp_path / "enabled"
    enabled.write_text(setting)
    monkeypatch.setattr(config_module, "THP_SETTING", str(enabled))
    monkeypatch.delenv("STREAMER_HUGEPAGES", raising=False)
    assert StreamerConfig().hugepages is expected
    monkeypatch.setenv("STREAMER_HUGEPAGES", "0")
    assert StreamerConfig().hugepages is False
    monkeypatch.setenv("STREAMER_HUGEPAGES", "1")
    assert StreamerConfig().hugepages is True


def test_no_thp_means_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "THP_SETTING", str(tmp_path / "missing"))
    monkeypatch.delenv("STREAMER_HUGEPAGES", raising=False)
    assert StreamerConfig().hugepages is False


def _thp_mode() -> str:
    try:
        text = Path(config_module.THP_SETTING).read_text()
    except OSError:
        return "missing"
    return text[text.index("[") + 1 : text.index("]")]


def _thp_eligible(address: int) -> bool:
    """``THPeligible`` of the mapping holding ``address``, from ``/proc/self/smaps``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(part, 16) for part in head.split("-"))
            inside = begin <= address < end
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(_thp_mode() != "madvise", reason="the advice is what differs only in THP 'madvise' mode")
def test_large_buffers_are_advised_small_ones_are_not() -> None:
    large = native.allocate(native.HUGEPAGE_MIN_BYTES, True)
    small = native.allocate(native.HUGEPAGE_MIN_BYTES - 4096, True)
    plain = native.allocate(native.HUGEPAGE_MIN_BYTES, False)
    try:
        address = int(native.ffi.cast("uintptr_t", large))
        assert address % (2 << 20) == 0  # aligned, so the kernel can map it with whole huge pages
        assert _thp_eligible(address)
        assert not _thp_eligible(int(native.ffi.cast("uintptr_t", small)))
        assert not _thp_eligible(int(native.ffi.cast("uintptr_t", plain)))
    finally:
        native.free(large, native.HUGEPAGE_MIN_BYTES, True)
        native.free(small, native.HUGEPAGE_MIN_BYTES - 4096, True)
        native.free(plain, native.HUGEPAGE_MIN_BYTES, False)


@pytest.mark.parametrize("hugepages", [True, False])
def test_loads_are_bit_exact_either_way(tmp_path: Path, hugepages: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    tensors = {
        "big": torch.randn(3 << 20, generator=generator),  # 12 MiB: a huge-page buffer
        "small": torch.randn(100, generator=generator),
    }
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    got = streamer.load(path, config=StreamerConfig(hugepages=hugepages, block_size=1 << 20))
    for name, tensor in tensors.items():
        assert torch.equal(got[name], tensor), name

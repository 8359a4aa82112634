"""Huge pages by default where the kernel has them (but not on VMs with free page reporting), for
large buffers only.

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
from streamer.config import StreamerConfig, default_config
from streamer.engine import native
from streamer.host import machine as config_module


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
    monkeypatch.setattr(config_module, "BALLOON_DEVICES", str(tmp_path / "no-balloon"))
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


def _balloon(root: Path, *features: str) -> Path:
    """A stand-in for ``/sys/bus/virtio/drivers/virtio_balloon``: one device per feature string."""
    for number, bits in enumerate(features):
        device = root / f"virtio{number}"
        device.mkdir(parents=True)
        (device / "features").write_text(bits + "\n")
    return root


REPORTING = "0110010" + "0" * 121  # STATS_VQ, DEFLATE_ON_OOM and REPORTING (bit 5): Firecracker's
HINTING_ONLY = "0111000" + "0" * 121  # FREE_PAGE_HINT (bit 3) only: pages stay with the guest


@pytest.mark.parametrize(
    ("features", "reporting"),
    [
        ((REPORTING,), True),
        ((HINTING_ONLY,), False),
        ((HINTING_ONLY, REPORTING), True),
        ((), False),
        (("01",), False),
    ],
)
def test_free_page_reporting_is_read_from_the_balloon_features(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, features: tuple[str, ...], reporting: bool
) -> None:
    monkeypatch.setattr(config_module, "BALLOON_DEVICES", str(_balloon(tmp_path / "balloon", *features)))
    assert config_module.free_page_reporting() is reporting


def test_no_balloon_driver_means_no_reporting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "BALLOON_DEVICES", str(tmp_path / "missing"))
    assert config_module.free_page_reporting() is False


def test_free_page_reporting_turns_the_default_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fresh huge page on such a VM is memory the host took back (faulted in again 4 KiB at a
    time); 4 KiB pages come first from free blocks too small to be reported."""
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    monkeypatch.setattr(config_module, "THP_SETTING", str(enabled))
    monkeypatch.setattr(config_module, "BALLOON_DEVICES", str(_balloon(tmp_path / "balloon", REPORTING)))
    monkeypatch.delenv("STREAMER_HUGEPAGES", raising=False)
    assert StreamerConfig().hugepages is False
    monkeypatch.setenv("STREAMER_HUGEPAGES", "1")
    assert StreamerConfig().hugepages is True


def test_a_call_without_a_config_follows_the_machine_default_as_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default config a call without one reuses (``streamer.config.default_config``) is built
    again when the machine's answer for ``hugepages`` changes, not only when a variable does."""
    monkeypatch.setattr(config_module, "BALLOON_DEVICES", str(tmp_path / "no-balloon"))
    monkeypatch.delenv("STREAMER_HUGEPAGES", raising=False)
    for setting, expected in [("always [madvise] never\n", True), ("always madvise [never]\n", False)]:
        enabled = tmp_path / f"enabled-{expected}"
        enabled.write_text(setting)
        monkeypatch.setattr(config_module, "THP_SETTING", str(enabled))
        assert default_config().hugepages is expected


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

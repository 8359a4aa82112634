"""What this machine offers a load, probed from the kernel: usable cores (affinity and cgroup
CPU quota), transparent huge pages, and whether a VM's balloon reports free memory to its host.
Read when a config is built or a run starts; nothing here is ever written."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

# Reader threads when ``concurrency`` is left to the machine. Warm reads are page-cache copies, so
# they scale with cores: on a 16-core host, 16 readers loaded a warm 4 GiB checkpoint into CPU
# memory 1.4-1.5x faster than 8 (10 of 10 rounds), and 32 were no faster than 16. Cold reads did
# not care (8 or 16). Staged (GPU) runs keep 8: there 16 were 7% slower warm, from their larger
# pinned ring (README, Configuration).
MIN_READERS = 8
MAX_READERS = 16
STAGED_READERS = 8
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


def usable_cores(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> int:
    """CPUs this process can keep busy: its affinity, cut by its cgroup's CPU quota (containers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, self_cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else max(1, cores)


def cgroup_cpu_quota(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> float | None:
    """CPUs' worth of time per period the process's cgroup may use; None when unlimited or unknown.

    cgroup v2: the tightest ``cpu.max`` ("max 100000" or "<quota> <period>") of the process's own
    cgroup (as ``self_cgroup`` names it under ``cgroup_root``) and its ancestors; v1: the ``cpu``
    controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: unlimited).
    """
    root = Path(cgroup_root)
    own = PurePosixPath("/", _own_cgroup(self_cgroup))
    found, quotas = False, []
    for cgroup in (own, *own.parents):
        try:
            quota, period = (root / cgroup.relative_to("/") / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        found = True
        share = None if quota == "max" else _quota(quota, period)
        if share is not None:
            quotas.append(share)
    if found:
        return min(quotas, default=None)
    try:
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _quota(quota, period)


def _own_cgroup(self_cgroup: str) -> str:
    """The process's cgroup v2 path (the ``0::<path>`` line of ``self_cgroup``), else "/"."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return "/"
    return next((line[3:].strip() or "/" for line in lines if line.startswith("0::")), "/")


def _quota(quota: str, period: str) -> float | None:
    try:
        share = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return share if share > 0 else None


def default_readers(*, cores: int) -> int:
    """Reader threads of a load into CPU memory when ``concurrency`` is unset (see ``MIN_READERS``)."""
    return min(MAX_READERS, max(MIN_READERS, cores))


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


BALLOON_DEVICES = "/sys/bus/virtio/drivers/virtio_balloon"
_BALLOON_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING, a bit of the device's negotiated features


def transparent_hugepages() -> bool:
    """Whether the kernel gives huge pages to memory that asks (THP ``always`` or ``madvise``)."""
    try:
        with open(THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False  # no THP (another OS, or a kernel without it)


def free_page_reporting() -> bool:
    """Whether this is a VM whose balloon hands free memory back to the host (free page reporting).

    Such a kernel reports each free block of 2 MiB or more to the host, which discards it; the
    next process to use that memory has the host fault every 4 KiB of it back in. Huge pages are
    always carved from those blocks; 4 KiB pages come first from smaller free blocks, which are
    never reported. ``features`` is the negotiated feature bits, one character per bit.
    """
    try:
        devices = list(Path(BALLOON_DEVICES).glob("virtio*"))
        features = [(device / "features").read_text().strip() for device in devices]
    except OSError:
        return False
    return any(len(bits) > _BALLOON_F_REPORTING and bits[_BALLOON_F_REPORTING] == "1" for bits in features)


def hugepages_by_default() -> bool:
    """Huge pages where the kernel has them, except on VMs with free page reporting (see there).
    Asked by every config that is built (a load with the default config builds one)."""
    return _kept(
        ("hugepages by default", THP_SETTING, BALLOON_DEVICES),
        lambda: transparent_hugepages() and not free_page_reporting(),
    )


def transparent_hugepages_kept() -> bool:
    """``transparent_hugepages()``, asked by every CPU run whose pages may be filled."""
    return _kept(("transparent hugepages", THP_SETTING), transparent_hugepages)


def _kept(key: tuple[str, ...], answer: Callable[[], bool]) -> bool:
    """``answer()``, kept for a second for the files it was read from (in ``key``): reading them
    costs more than the rest of a small run's set-up."""
    now = time.monotonic()
    kept = _KEPT.get(key)
    if kept is None or now - kept[0] > _KEEP_SECONDS:
        kept = (now, answer())
        _KEPT[key] = kept
    return kept[1]


_KEEP_SECONDS = 1.0
_KEPT: dict[tuple[str, ...], tuple[float, bool]] = {}

"""Facts about the machine and the software, recorded with every result."""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
import sys
import urllib.parse
from importlib import metadata
from pathlib import Path
from typing import Any

from streamer.host.machine import free_page_reporting


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def filesystem(path: Path) -> dict[str, str | None]:
    """The mount holding ``path``: its type, device and mount point (longest /proc/mounts match)."""
    target = str(path.resolve())
    best: tuple[str, str, str] | None = None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            mount = mount.replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and (best is None or len(mount) >= len(best[1])):
                best = (device, mount, fstype)
    except OSError:
        pass
    if best is None:
        return {"type": None, "device": None, "mount": None}
    return {"type": best[2], "device": best[0], "mount": best[1]}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _fio_version() -> str | None:
    if shutil.which("fio") is None:
        return None
    try:
        return subprocess.run(["fio", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def s3_endpoint() -> dict[str, str | None]:
    """Where this run's S3 requests go, from the same settings streamer uses (the standard AWS
    variables): scheme and host[:port] only, never credentials or a path. ``endpoint_host`` None:
    AWS's own endpoint for the region."""
    from streamer.config import S3Config

    config = S3Config()
    url = urllib.parse.urlsplit(config.endpoint_url or "")
    host = url.hostname and (f"{url.hostname}:{url.port}" if url.port else url.hostname)
    return {
        "endpoint_host": host or None,
        "scheme": url.scheme or None,
        "region": config.region,
        "addressing_style": config.addressing_style,
    }


def facts(
    source_path: Path | None, probe: dict[str, Any], s3: dict[str, str | None] | None
) -> dict[str, Any]:
    """Everything the JSON ``machine`` object holds (see ``schema.json``); ``source_path`` is None
    for an S3 source, whose endpoint is ``s3``."""
    versions: dict[str, str | None] = {
        name: entry.get("version") for name, entry in probe.get("loaders", {}).items()
    }
    versions.update(
        {
            "python": platform.python_version(),
            "torch": probe.get("torch"),
            "numpy": _version("numpy"),
            "fio": _fio_version(),
        }
    )
    cuda = probe.get("cuda", {})
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_bytes": _ram_bytes(),
        "kernel": platform.release(),
        "free_page_reporting": free_page_reporting(),
        "os": platform.platform(),
        "filesystem": filesystem(source_path) if source_path else dict.fromkeys(("type", "device", "mount")),
        "s3": s3,
        "gpu": {
            "available": bool(cuda.get("available")),
            "devices": cuda.get("devices", []),
            "cuda": cuda.get("version"),
        },
        "python_executable": sys.executable,
        "versions": versions,
    }

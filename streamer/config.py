"""The one typed configuration object, with environment variables as defaults.

Environment variables are read when a ``StreamerConfig`` is built, never
written: two loaders in one process can use different settings.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

from streamer.errors import ConfigError

IoMode = Literal["auto", "buffered", "direct"]
IO_MODES: tuple[IoMode, ...] = ("auto", "buffered", "direct")

DIRECT_IO_ALIGNMENT = 4096
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, *, name: str) -> int:
    """Parses ``"64MiB"``, ``"2G"``, ``"4096"`` (binary units) into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_PATTERN.match(text)
    if match is None:
        raise ConfigError(f"{name}: cannot parse size {text!r} (examples: 8MiB, 2G, 4096)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _env_size(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() in ("none", "unlimited", "0"):
        return None
    return parse_size(raw, name=name)


def _env_io_mode() -> IoMode:
    raw = os.environ.get("STREAMER_IO_MODE", "auto").strip().lower()
    for mode in IO_MODES:
        if raw == mode:
            return mode
    raise ConfigError(f"STREAMER_IO_MODE={raw!r}: expected one of {', '.join(IO_MODES)}")


@dataclass(frozen=True)
class StreamerConfig:
    """How a load runs.

    concurrency: reader threads (local) or in-flight requests (S3).
    block_size: bytes per read; tensors are cut into, or grouped by, blocks of this size.
    memory_limit: cap on host bytes held by a streaming load (in flight, undelivered and
        still referenced by the consumer); ``None`` means unbounded. ``load()`` keeps every
        tensor, so it ignores the limit.
    io_mode: ``auto`` reads files already in the page cache buffered and the others with
        O_DIRECT; ``buffered`` or ``direct`` force one strategy for every file.
    hugepages: back CPU destinations with transparent huge pages. Off by default: on the
        VMs we measure on, fresh huge pages fault in at 1.3-6.9 GB/s from run to run while
        4 KiB pages hold a steady ~2.4 GB/s (see the issue notes); bare metal may prefer on.
    """

    concurrency: int = field(default_factory=lambda: _env_int("STREAMER_CONCURRENCY", 8))
    block_size: int = field(
        default_factory=lambda: parse_size(
            os.environ.get("STREAMER_BLOCK_SIZE") or "8MiB", name="STREAMER_BLOCK_SIZE"
        )
    )
    memory_limit: int | None = field(default_factory=lambda: _env_size("STREAMER_MEMORY_LIMIT", None))
    io_mode: IoMode = field(default_factory=_env_io_mode)
    hugepages: bool = field(default_factory=lambda: _env_int("STREAMER_HUGEPAGES", 0) != 0)

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 1024:
            raise ConfigError(f"concurrency must be in 1..1024, got {self.concurrency}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.memory_limit is not None and self.memory_limit < 1:
            raise ConfigError(f"memory_limit must be positive or None, got {self.memory_limit}")
        if self.io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {self.io_mode!r}")

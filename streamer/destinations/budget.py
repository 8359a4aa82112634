"""How many tensor bytes a streaming load may hold: the user's ``memory_limit``, or one sized
from the checkpoint and the memory the host has left.

Without a bound, readers run ahead of a consumer that drops each tensor until the machine runs
out of memory; with a fixed one, a checkpoint of large tensors stops overlapping reads with the
consumer. The auto budget fits the tensor the consumer holds plus the next two being read (and a
round of block reads), so reading never waits for the consumer in the normal ``for`` loop.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import NamedTuple

import torch

from streamer.config import UNLIMITED, StreamerConfig

AUTO_FLOOR = 1 << 30  # below this, small-tensor checkpoints read in too many small segments
AUTO_TENSORS = 3  # the consumer's current tensor and the next two, being read
AVAILABLE_SHARE = 2  # the auto budget takes at most 1/2 of the memory available
_NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a number close to 2**63


class StreamingBudget(NamedTuple):
    """The limit a run works under (None: unbounded) and, for ``metrics``, why it is that."""

    limit: int | None
    source: str


def streaming_budget(
    config: StreamerConfig,
    tensor_bytes: Sequence[int],
    available: Callable[[], int | None] | None = None,
) -> StreamingBudget:
    """The budget for a run reading tensors of ``tensor_bytes``; ``available`` probes host memory."""
    if config.memory_limit == UNLIMITED:
        return StreamingBudget(None, "unlimited")
    if config.explicit_memory_limit is not None:
        return StreamingBudget(config.explicit_memory_limit, "user")
    probe = available if available is not None else available_memory
    return auto_budget(
        max(tensor_bytes, default=0), in_flight=config.readers() * config.block_size, available=probe()
    )


def auto_budget(largest: int, *, in_flight: int, available: int | None) -> StreamingBudget:
    """``AUTO_TENSORS`` of the largest tensor plus a round of reads, at least ``AUTO_FLOOR``, at most
    half of ``available``, but never less than the two tensors a ``for`` loop holds at once."""
    wanted = AUTO_TENSORS * largest + in_flight
    reason = f"{AUTO_TENSORS} x largest tensor ({_gib(largest)}) + in-flight reads ({_gib(in_flight)})"
    if wanted < AUTO_FLOOR:
        wanted, reason = AUTO_FLOOR, f"floor {_gib(AUTO_FLOOR)} (more than {reason})"
    if available is None:
        return StreamingBudget(wanted, f"auto: {reason}; available memory unknown")
    cap = available // AVAILABLE_SHARE
    if wanted <= cap:
        return StreamingBudget(wanted, f"auto: {reason}")
    needed = 2 * largest
    if cap < needed:
        return StreamingBudget(
            needed, f"auto: 2 x largest tensor ({_gib(largest)}), more than half of available memory"
        )
    return StreamingBudget(cap, f"auto: half of available memory ({_gib(available)}), less than {reason}")


def over_limit_message(limit: int, held: int) -> str:
    """What a load says, once, when the tensors it handed out and the caller still holds exceed an
    explicit ``memory_limit`` (a ``for`` loop's or ``get_tensor``'s alike)."""
    return (
        f"memory_limit {limit} exceeded: the tensors handed out and still referenced hold {held} bytes; "
        "reading goes on one segment at a time. Drop (del) tensors you are done with, raise or unset "
        "memory_limit, or use streamer.load() to keep everything"
    )


def warn_from_caller(message: str) -> None:
    """A ``RuntimeWarning`` pointed at the first frame outside streamer: the loop calling ``next()``
    or ``get_tensor()``, however many of streamer's frames lie between."""
    level = 1  # this frame: the one that calls warnings.warn
    frame: FrameType | None = sys._getframe(0)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "streamer":
        level, frame = level + 1, frame.f_back
    warnings.warn(message, RuntimeWarning, stacklevel=level)


class HeldTensors:
    """Bytes of the tensors a handle gave out one at a time (``get_tensor``) that the caller still
    references: each is counted until it is collected."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def hold(self, tensor: torch.Tensor) -> None:
        size = tensor.nbytes
        with self._lock:
            self.bytes += size
        weakref.finalize(tensor, self._drop, size)

    def _drop(self, size: int) -> None:
        with self._lock:
            self.bytes -= size


def available_memory(proc: Path = Path("/proc"), cgroup_fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process can still get: ``MemAvailable``, or less where a cgroup limit is closer.

    None when neither can be read (not Linux).
    """
    known = [_meminfo_available(proc / "meminfo")]
    known += [_cgroup_headroom(directory) for directory in _cgroup_dirs(proc / "self" / "cgroup", cgroup_fs)]
    values = [value for value in known if value is not None]
    return min(values) if values else None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_dirs(self_cgroup: Path, cgroup_fs: Path) -> list[Path]:
    """The memory controller's directories of this process's cgroup (v2 and v1)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, relative = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            root = cgroup_fs
        elif "memory" in controllers.split(","):
            root = cgroup_fs / "memory"
        else:
            continue
        own = root / relative.lstrip("/")
        found.append(own if own.is_dir() else root)  # inside a container the path may not resolve
    return found


def _cgroup_headroom(directory: Path) -> int | None:
    """Limit minus what the cgroup uses, not counting page cache it could drop; None if unlimited."""
    v2, v1 = ("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
    for limit_name, usage_name in (v2, v1):
        try:
            limit_text = (directory / limit_name).read_text().strip()
            usage = int((directory / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= _NO_CGROUP_LIMIT:
            return None
        reclaimable = _stat(directory / "memory.stat", ("inactive_file", "total_inactive_file"))
        return max(int(limit_text) - usage + reclaimable, 0)
    return None


def _stat(path: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        key, _, value = line.partition(" ")
        if key in keys and value.strip().isdigit():
            return int(value)
    return 0


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"

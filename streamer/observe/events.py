"""One event per load: what a handle read from its open to its close, logged once on the
``streamer`` logger (a line for people, or JSON for log pipelines) and, when enabled, recorded
in Prometheus collectors (``streamer.observe.prometheus``).

A load is a handle's life: ``load``, ``load_file`` and ``load_into`` open and close one; a
``streamer.open`` or ``safe_open`` handle reports when it is closed (its ``with`` block ends).
The event never holds a secret: the source is its scheme plus a location stripped of any query,
fragment or user part (an Azure SAS or a presigned URL lives there), and a failure is its
exception type, not its message.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from streamer.config import StreamerConfig

LOGGER = logging.getLogger("streamer")

# Summed over every read of the handle: the keys of ``Streamer.metrics`` they come from.
_SUMMED = (
    "bytes",
    "bytes_read",
    "requests",
    "retries",
    "throttles",
    "checked_objects",
    "cache_hit_bytes",
    "cache_miss_bytes",
    "cache_write_bytes",
    "cache_errors",
    "cache_dropped",
    "cache_evictions",
    "consumer_wait_s",
    "memory_wait_s",
)


class LoadEvent(NamedTuple):
    """What one load did; ``as_dict`` is the JSON form. ``storage_wait_s``: the consumer waited
    for bytes; ``consumer_stall_s``: reads waited for memory the consumer still held."""

    source: str
    scheme: str
    device: str
    result: str  # "ok" or "error"
    error: str  # the exception's type name; "" when ok
    files: int
    tensors: int
    bytes: int  # tensor bytes handed out
    bytes_read: int  # bytes this process read from storage (or its cache)
    seconds: float
    gb_per_s: float
    time_to_first_tensor_s: float | None
    storage_wait_s: float
    consumer_stall_s: float
    requests: int
    retries: int
    throttles: int
    checked_objects: int  # objects read whole whose store checksum matched (GCS's CRC32C)
    cache_hit_bytes: int
    cache_miss_bytes: int
    cache_write_bytes: int
    cache_checksum_failures: int
    cache_dropped: int
    cache_evictions: int
    group_received_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return self._asdict()

    def line(self) -> str:
        """The event for people: one line."""
        what = f"{self.bytes / 1e9:.3f} GB in {self.tensors} tensor(s)"
        what += f" of {self.files} file(s) from {self.source}"
        if self.result == "ok":
            head = f"streamer: loaded {what} in {self.seconds:.3f} s ({self.gb_per_s:.2f} GB/s)"
        else:
            head = f"streamer: load FAILED ({self.error}) after {self.seconds:.3f} s: {what}"
        parts = [head, f"read {self.bytes_read / 1e9:.3f} GB"]
        if self.requests:
            parts.append(f"{self.requests} requests, {self.retries} retries, {self.throttles} throttled")
        if self.checked_objects:
            parts.append(f"{self.checked_objects} object(s) checked whole")
        if self.cache_hit_bytes or self.cache_miss_bytes:
            parts.append(
                f"cache hit {self.cache_hit_bytes / 1e9:.3f} GB, miss {self.cache_miss_bytes / 1e9:.3f} GB"
            )
        if self.group_received_bytes:
            parts.append(f"{self.group_received_bytes / 1e9:.3f} GB from the group")
        return "; ".join(parts)


class LoadRecord:
    """Accumulates one handle's reads into its ``LoadEvent``."""

    def __init__(self, source: str | list[str], device: str) -> None:
        self._opened = time.perf_counter()
        self._source = source  # shown (public_source) only if an event is made: not on the load's path
        self._device = device
        self._sums = dict.fromkeys(_SUMMED, 0.0)
        self._files = self._tensors = self._group_bytes = 0
        self._first_tensor: float | None = None
        self._ended: float | None = None
        self._error: str | None = None
        self._reads = 0
        self._reported = False

    def add(self, measured: dict[str, Any]) -> None:
        """Folds in one read's ``Streamer.metrics`` (empty for a read that never ran)."""
        if not measured:
            return
        self._reads += 1
        for key in _SUMMED:
            self._sums[key] += measured.get(key) or 0
        self._files = max(self._files, measured.get("files", 0))
        self._tensors += measured.get("tensors", 0)
        self._group_bytes += (measured.get("group") or {}).get("received_bytes", 0)
        first = measured.get("time_to_first_tensor_s")
        if self._first_tensor is None and first is not None:
            self._first_tensor = (measured.get("started_at", self._opened) - self._opened) + first
        ended = measured.get("ended_at")
        if ended is not None:
            self._ended = ended if self._ended is None else max(self._ended, ended)

    def fail(self, error: BaseException) -> None:
        """The load failed (its first failure is the one reported)."""
        if self._error is None:
            self._error = type(error).__name__

    def event(self) -> LoadEvent | None:
        """The load's event, once: None when it was already reported or nothing was read or failed."""
        if self._reported or (self._reads == 0 and self._error is None):
            return None
        self._reported = True
        end = self._ended if self._ended is not None and self._error is None else time.perf_counter()
        seconds = max(end - self._opened, 0.0)
        sums = self._sums
        source, scheme = public_source(shown_source(self._source))
        return LoadEvent(
            source=source,
            scheme=scheme,
            device=self._device,
            result="ok" if self._error is None else "error",
            error=self._error or "",
            files=self._files,
            tensors=self._tensors,
            bytes=int(sums["bytes"]),
            bytes_read=int(sums["bytes_read"]),
            seconds=seconds,
            gb_per_s=sums["bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
            time_to_first_tensor_s=self._first_tensor,
            storage_wait_s=max(sums["consumer_wait_s"] - sums["memory_wait_s"], 0.0),
            consumer_stall_s=sums["memory_wait_s"],
            requests=int(sums["requests"]),
            retries=int(sums["retries"]),
            throttles=int(sums["throttles"]),
            checked_objects=int(sums["checked_objects"]),
            cache_hit_bytes=int(sums["cache_hit_bytes"]),
            cache_miss_bytes=int(sums["cache_miss_bytes"]),
            cache_write_bytes=int(sums["cache_write_bytes"]),
            cache_checksum_failures=int(sums["cache_errors"]),
            cache_dropped=int(sums["cache_dropped"]),
            cache_evictions=int(sums["cache_evictions"]),
            group_received_bytes=self._group_bytes,
        )


def report(record: LoadRecord, config: StreamerConfig) -> None:
    """Logs the load's event (INFO, ``config.log_format``) and records it where ``config`` asks;
    the event is made only when something listens. Never raises (an exporter that cannot write
    warns once and the load goes on)."""
    logged = LOGGER.isEnabledFor(logging.INFO)
    if not logged and not config.records_metrics:
        return
    event = record.event()
    if event is None:
        return
    if logged:
        text = json.dumps(event.as_dict(), sort_keys=True) if config.log_format == "json" else event.line()
        LOGGER.info(text, extra={"streamer_load": event.as_dict()})
    if config.records_metrics:
        try:
            from streamer.observe import prometheus
        except ImportError:
            warn_once(
                "prometheus-missing",
                "streamer: metrics are on but prometheus-client is not installed "
                "(pip install 'streamer-weights[prometheus]'); loads are not recorded",
            )
            return
        prometheus.record(event, textfile=config.metrics_textfile)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """A ``RuntimeWarning`` the first time ``key`` comes up in this process: an exporter that keeps
    failing says so once, not at every load."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def shown_source(source: str | list[str]) -> str:
    """The source as the load's event names it: its path or URI, or the first of several."""
    if isinstance(source, str):
        return source
    return "" if not source else source[0] + (f" (+{len(source) - 1} more)" if len(source) > 1 else "")


def public_source(source: str) -> tuple[str, str]:
    """``source`` as an event may show it, and its scheme (``file`` for a local path): a URI
    loses its user part, query and fragment, where credentials travel."""
    parsed = urllib.parse.urlsplit(source)
    if len(parsed.scheme) <= 1 or not parsed.netloc:  # a path (a drive letter is no scheme)
        return source, "file"
    scheme = parsed.scheme.lower()
    host = parsed.hostname or ""
    if scheme == "https" and host.endswith(".blob.core.windows.net"):
        scheme = "az"
    elif scheme == "https" and host == "storage.googleapis.com":
        scheme = "gs"
    netloc = host + (f":{parsed.port}" if parsed.port else "")
    return urllib.parse.urlunsplit((parsed.scheme, netloc, parsed.path, "", "")), scheme

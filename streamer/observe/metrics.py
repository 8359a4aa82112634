"""What a load measured about itself, available as a plain dict afterwards."""

from __future__ import annotations

import time
from dataclasses import field
from typing import Any

from streamer.records import record


@record(frozen=False)
class LoadMetrics:
    """Counters of one run. Times are seconds; ``*_wait_seconds`` are stalls of the consumer."""

    files: int = 0
    tensors: int = 0
    bytes: int = 0
    blocks: int = 0
    readers: int = 0  # the engine's reader threads (1 where the storage fetches the bytes itself)
    seconds: float = 0.0
    time_to_first_tensor: float | None = None
    consumer_wait_seconds: float = 0.0
    memory_wait_seconds: float = 0.0
    alloc_seconds: float = 0.0
    # CPU streaming: bytes charged to the budget at most at once (tensors' buffers, and the
    # readers' buffers of an O_DIRECT page fill under an automatic budget)
    peak_buffer_bytes: int = 0
    memory_limit: int | None = None  # CPU streaming: the budget in force (None: unbounded)
    memory_limit_source: str = ""  # CPU streaming: "user", "unlimited" or "auto: <how it was sized>"
    buffers_reused: int = 0  # CPU loads: segments read into a buffer whose views had all died
    ring_alloc_seconds: float = 0.0  # staged loads: allocating (pinning) the host ring
    copy_wait_seconds: float = 0.0  # staged loads: consumer blocked on copies with no read in flight
    ring_stalls: int = 0  # staged loads: times a read could not start because every slot was busy
    copies: int = 0  # staged loads: copies out of the ring
    prefault_bytes: int = 0  # S3 and O_DIRECT reads into CPU buffers: bytes faulted in ahead of the data
    page_fill: str = ""  # CPU loads of local files: "on", why it is off, or "" where not tried
    engine: dict[str, float] = field(default_factory=dict)
    storage: dict[str, int] = field(default_factory=dict)  # the storage's own counters (Feed.stats)
    _started: float = 0.0
    _ended: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def tensor_delivered(self) -> None:
        if self.time_to_first_tensor is None:
            self.time_to_first_tensor = time.perf_counter() - self._started

    def add_wait(self, seconds: float, blocked_on_memory: bool) -> None:
        self.consumer_wait_seconds += seconds
        if blocked_on_memory:
            self.memory_wait_seconds += seconds

    def add_alloc(self, seconds: float) -> None:
        self.alloc_seconds += seconds

    def add_ring_alloc(self, seconds: float) -> None:
        self.ring_alloc_seconds += seconds

    def add_copy_wait(self, seconds: float) -> None:
        self.consumer_wait_seconds += seconds
        self.copy_wait_seconds += seconds

    def add_engine_stats(self, stats: dict[str, float]) -> None:
        self.engine = dict(stats)

    def add_storage_stats(self, stats: dict[str, int]) -> None:
        self.storage = dict(stats)

    def finish(self, peak_buffer_bytes: int) -> None:
        self._ended = time.perf_counter()
        self.seconds = self._ended - self._started
        self.peak_buffer_bytes = peak_buffer_bytes

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-friendly view; ``gb_per_s`` counts tensor bytes per wall second (1 GB = 1e9 B)."""
        return {
            "files": self.files,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "gb_per_s": self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0,
            "time_to_first_tensor_s": self.time_to_first_tensor,
            "blocks": self.blocks,
            "readers": self.readers,
            "direct_files": self.storage.get("direct_files", 0),  # local files read with O_DIRECT
            "buffered_files": self.storage.get("buffered_files", 0),  # local files read through the cache
            "consumer_wait_s": self.consumer_wait_seconds,
            "memory_wait_s": self.memory_wait_seconds,
            "alloc_s": self.alloc_seconds,
            "peak_buffer_bytes": self.peak_buffer_bytes,
            "memory_limit": self.memory_limit,
            "memory_limit_source": self.memory_limit_source,
            "buffers_reused": self.buffers_reused,
            "ring_alloc_s": self.ring_alloc_seconds,
            "copy_wait_s": self.copy_wait_seconds,
            "ring_stalls": self.ring_stalls,
            "copies": self.copies,
            "bytes_read": int(self.engine.get("bytes_read", 0)),
            "read_s": self.engine.get("read_seconds", 0.0),
            "worker_idle_s": self.engine.get("idle_seconds", 0.0),
            "s3_files": self.storage.get("s3_files", 0),
            "gcs_files": self.storage.get("gcs_files", 0),
            "azure_files": self.storage.get("azure_files", 0),
            "prefault_bytes": self.prefault_bytes,
            "page_fill": self.page_fill,
            "filled_bytes": int(self.engine.get("bytes_filled", 0)),  # placed through the page fill
            "mapped_bytes": int(self.engine.get("bytes_mapped", 0)),  # of those, straight from the cache
            "requests": self.storage.get("requests", 0),  # object-store requests, retries included
            "retries": self.storage.get("retries", 0),  # object-store tries that failed and were retried
            "throttles": self.storage.get("throttles", 0),  # of those, refused as throttled (429, 503)
            "checked_objects": self.storage.get("checked_objects", 0),  # read whole, checksum matched
            "cache_hit_bytes": self.storage.get("cache_hit_bytes", 0),  # cache: chunk bytes read from it
            "cache_miss_bytes": self.storage.get("cache_miss_bytes", 0),  # cache: chunk bytes fetched from S3
            "cache_write_bytes": self.storage.get("cache_write_bytes", 0),  # cache: chunk bytes stored
            "cache_errors": self.storage.get("cache_errors", 0),  # cache: chunks failing their check
            "cache_dropped": self.storage.get("cache_dropped", 0),  # cache: chunks not written (disk behind)
            "cache_evictions": self.storage.get("cache_evictions", 0),  # cache: chunks evicted for room
            "started_at": self._started,  # time.perf_counter() at the start and the end (None: unfinished)
            "ended_at": self._ended,
        }

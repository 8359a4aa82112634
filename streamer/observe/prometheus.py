"""Every load recorded in Prometheus collectors (``StreamerConfig.metrics``; the ``[prometheus]``
extra): loads by result, bytes by origin, requests, retries and throttles by storage, the node
cache's writes, drops, evictions and checksum failures, and histograms of seconds, time to first
tensor, GB/s, and the time spent waiting on storage or on the consumer.

Labels are few and bounded: the storage scheme (``file``, ``s3``, ``gs``, ``az``), the device
type, the result and the error's type name; never a path, key or credential.

The collectors live in a registry of their own (``REGISTRY``), itself registered in
``prometheus_client``'s default registry: an exporter the process already has (``vLLM``'s
``/metrics``, ``start_http_server``) shows them, and ``write_textfile`` writes only them. Under
``PROMETHEUS_MULTIPROC_DIR`` their values go to that directory, as ``prometheus_client`` does for
every collector, for the exporter's ``MultiProcessCollector``. ``DirectoryCollector`` sums the
textfiles that several processes write (``metrics_textfile`` with ``{pid}``): how vLLM's API
server shows what its engine's workers loaded.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import CollectorRegistry, Counter, Histogram, write_to_textfile
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from streamer.observe.events import LoadEvent, warn_once

SCHEMES = ("file", "s3", "gs", "az")
_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_GBPS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_LOAD = ("scheme", "device")

REGISTRY = CollectorRegistry(auto_describe=True)


_STORE = ("scheme",)
_ORIGIN = (*_LOAD, "origin")


@dataclass(frozen=True)
class Series:
    """One collector: its name (a counter's samples add ``_total``), help text, labels and, for a
    histogram, its buckets."""

    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None  # None: a counter


SERIES = (
    Series("streamer_loads", "Loads, by result and error type", (*_LOAD, "result", "error")),
    Series("streamer_loaded_bytes", "Tensor bytes handed out by loads", _LOAD),
    Series("streamer_read_bytes", "Bytes read, by origin: storage, cache_hit, cache_miss, group", _ORIGIN),
    Series("streamer_requests", "Object-store requests, retries included", _STORE),
    Series("streamer_retries", "Object-store tries that failed and were retried", _STORE),
    Series("streamer_throttles", "Retried tries the store refused as throttled (429, 503)", _STORE),
    Series("streamer_cache_write_bytes", "Bytes written into the node cache", _STORE),
    Series("streamer_cache_dropped_chunks", "Chunks not written into the node cache (disk behind)", _STORE),
    Series("streamer_cache_evictions", "Chunks evicted from the node cache to stay in its size", _STORE),
    Series("streamer_cache_checksum_failures", "Node-cache chunks that failed their checksum", _STORE),
    Series("streamer_load_seconds", "Load wall time, open to last byte", (*_LOAD, "result"), _SECONDS),
    Series("streamer_time_to_first_tensor_seconds", "Open to the first tensor handed out", _LOAD, _SECONDS),
    Series("streamer_load_gbps", "Tensor GB (1e9 bytes) per second of a load", _LOAD, _GBPS),
    Series("streamer_storage_wait_seconds", "Time the consumer waited on storage", _LOAD, _SECONDS),
    Series("streamer_consumer_stall_seconds", "Time reads waited on the consumer", _LOAD, _SECONDS),
)


class LoadCollectors:
    """The ``SERIES`` collectors, in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counters = {
            series.name: Counter(series.name, series.help, series.labels, registry=registry)
            for series in SERIES
            if series.buckets is None
        }
        self._histograms = {
            series.name: Histogram(
                series.name, series.help, series.labels, registry=registry, buckets=series.buckets
            )
            for series in SERIES
            if series.buckets is not None
        }

    def record(self, event: LoadEvent) -> None:
        scheme = event.scheme if event.scheme in SCHEMES else "other"
        load = (scheme, event.device)
        self._counters["streamer_loads"].labels(*load, event.result, event.error).inc()
        self._counters["streamer_loaded_bytes"].labels(*load).inc(event.bytes)
        cached = event.cache_hit_bytes + event.cache_miss_bytes
        origins = {
            "storage": max(event.bytes_read - cached, 0),
            "cache_hit": event.cache_hit_bytes,
            "cache_miss": event.cache_miss_bytes,
            "group": event.group_received_bytes,
        }
        for origin, nbytes in origins.items():
            self._counters["streamer_read_bytes"].labels(*load, origin).inc(nbytes)
        for name, count in (
            ("streamer_requests", event.requests),
            ("streamer_retries", event.retries),
            ("streamer_throttles", event.throttles),
            ("streamer_cache_write_bytes", event.cache_write_bytes),
            ("streamer_cache_dropped_chunks", event.cache_dropped),
            ("streamer_cache_evictions", event.cache_evictions),
            ("streamer_cache_checksum_failures", event.cache_checksum_failures),
        ):
            self._counters[name].labels(scheme).inc(count)
        self._histograms["streamer_load_seconds"].labels(*load, event.result).observe(event.seconds)
        if event.result != "ok":
            return
        for name, seconds in (
            ("streamer_load_gbps", event.gb_per_s),
            ("streamer_storage_wait_seconds", event.storage_wait_s),
            ("streamer_consumer_stall_seconds", event.consumer_stall_s),
            ("streamer_time_to_first_tensor_seconds", event.time_to_first_tensor_s),
        ):
            if seconds is not None:
                self._histograms[name].labels(*load).observe(seconds)


_lock = threading.Lock()
_collectors: LoadCollectors | None = None


def collectors() -> LoadCollectors:
    """This process's collectors, made (and registered) on first use."""
    global _collectors
    with _lock:
        if _collectors is None:
            _collectors = LoadCollectors(REGISTRY)
            DEFAULT_REGISTRY.register(REGISTRY)
        return _collectors


def record(event: LoadEvent, *, textfile: str | None = None) -> None:
    """Records ``event``, then writes the textfile if one is asked for. A directory that cannot be
    written (``PROMETHEUS_MULTIPROC_DIR``, the textfile's) warns once and never fails the load."""
    try:
        collectors().record(event)
    except OSError as error:
        warn_once("record", f"streamer: load metrics not recorded ({error}); the load went on")
    if textfile is not None:
        path = textfile.replace("{pid}", str(os.getpid()))
        try:
            write_textfile(path)
        except OSError as error:
            warn_once(f"textfile {path}", f"streamer: cannot write metrics textfile {path!r} ({error})")


def write_textfile(path: str) -> None:
    """Writes this process's ``streamer_*`` series to ``path`` in the node exporter's textfile
    format, atomically (a scrape never sees half a file)."""
    write_to_textfile(path, REGISTRY)


class DirectoryCollector:
    """The ``streamer_*`` series of every ``*.prom`` textfile in ``directory``, summed by name and
    labels: what several processes (each writing ``streamer-{pid}.prom``) loaded, as one."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for path in sorted(glob.glob(os.path.join(glob.escape(self.directory), "*.prom"))):
            try:
                with open(path, encoding="utf-8") as file:
                    text = file.read()
                families = list(text_string_to_metric_families(text))
            except (OSError, ValueError):
                continue  # being replaced, or not one of ours: the next scrape reads it
            for family in families:
                if not family.name.startswith("streamer_"):
                    continue
                merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                totals = sums.setdefault(family.name, {})
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue  # when one process made the series: no sum means anything
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    totals[key] = totals.get(key, 0.0) + sample.value
        for name, metric in merged.items():
            for (sample_name, labels), value in sums[name].items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric

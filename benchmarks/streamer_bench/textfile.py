"""``--prometheus-textfile``: a bench run's results in the node exporter's textfile format, so a
fleet's nodes can run the bench on a schedule and chart the loaders and the machine's ceilings
next to the load metrics streamer itself exports.

Gauges, one sample per cache state and loader setting (the label values are the bench's own few):
``streamer_bench_seconds`` (median seconds of a load), ``streamer_bench_gbps``,
``streamer_bench_ratio`` (each peer's paired ratio, peer time ÷ streamer's, and its interval
bounds under ``bound``), ``streamer_bench_ceiling_gbps`` and ``streamer_bench_timestamp_seconds``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

_SETTING = ("cache", "loader", "setting")


def write(document: dict[str, Any], path: Path) -> None:
    """Writes ``document``'s results to ``path`` (atomically: a scrape never sees half a file)."""
    registry = CollectorRegistry()
    seconds = Gauge("streamer_bench_seconds", "Median seconds of a load", _SETTING, registry=registry)
    gbps = Gauge(
        "streamer_bench_gbps", "Tensor GB (1e9 bytes) per second, median", _SETTING, registry=registry
    )
    ratio = Gauge(
        "streamer_bench_ratio",
        "Peer seconds over streamer's, paired by round (above 1: streamer faster); bound: median, low, high",
        ("cache", "peer", "bound"),
        registry=registry,
    )
    ceiling = Gauge(
        "streamer_bench_ceiling_gbps",
        "The machine's ceilings measured by the run",
        ("cache", "name"),
        registry=registry,
    )
    stamp = Gauge("streamer_bench_timestamp_seconds", "When the results were written", registry=registry)
    for section in document["sections"]:
        cache = section["cache"]
        for result in section["results"]:
            if result.get("status", "ok") != "ok" or result.get("median_s") is None:
                continue
            labels = (cache, result["loader"], result["setting"])
            seconds.labels(*labels).set(result["median_s"])
            if result.get("gbps") is not None:
                gbps.labels(*labels).set(result["gbps"])
        for compared in section.get("comparisons", []):
            peer = f"{compared['loader']} {compared['setting']}"
            for bound, key in (("median", "ratio"), ("low", "low"), ("high", "high")):
                if compared.get(key) is not None:
                    ratio.labels(cache, peer, bound).set(compared[key])
        for measured in section.get("ceilings", []):
            if measured.get("gbps"):
                ceiling.labels(cache, measured["name"]).set(measured["gbps"])
    for measured in document.get("memory_ceilings", []):
        if measured.get("gbps"):
            ceiling.labels("memory", measured["name"]).set(measured["gbps"])
    stamp.set(time.time())
    write_to_textfile(str(path), registry)

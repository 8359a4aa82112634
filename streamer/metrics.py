"""Load metrics for Prometheus (the ``[prometheus]`` extra).

Turn recording on with ``StreamerConfig(metrics=True)`` or ``STREAMER_METRICS=1``: every load
then counts into the ``streamer_*`` series of ``SERIES``, which the process's default
``prometheus_client`` registry shows (so an exporter the process already has, vLLM's
``/metrics`` included, serves them). For a process with no exporter, ``serve`` starts one, and
``write_textfile`` (or ``STREAMER_METRICS_TEXTFILE``) leaves them for the node exporter's
textfile collector. ``import streamer`` does not import this module or ``prometheus_client``.
"""

from __future__ import annotations

from prometheus_client import start_http_server

from streamer.observe.prometheus import (
    REGISTRY,
    SERIES,
    DirectoryCollector,
    Series,
    collectors,
    write_textfile,
)

__all__ = ["REGISTRY", "SERIES", "DirectoryCollector", "Series", "serve", "write_textfile"]


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serves this process's metrics (the default registry: ``streamer_*`` and the process's own)
    on ``http://addr:port/metrics``, from a daemon thread."""
    collectors()  # the series exist (at zero) before the first load: a scrape sees them at once
    start_http_server(port, addr)

"""vLLM plugin: ``--load-format streamer`` loads safetensors checkpoints with streamer.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and calls it in
every process it starts (API server, engine core, workers). Importing this package imports
neither vLLM nor torch; :func:`register` imports vLLM lazily, never touches CUDA, and
registers the loader once per process however often it is called.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from streamer_vllm.options import KEYS, METRICS_DIR_ENV, LoaderOptions, parse_options

LOAD_FORMAT = "streamer"

__all__ = ["KEYS", "LOAD_FORMAT", "LoaderOptions", "parse_options", "register"]

_registered = False


def register() -> None:
    """Registers ``StreamerModelLoader`` as vLLM's load format ``streamer`` (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from streamer_vllm.loader import StreamerModelLoader

    register_model_loader(LOAD_FORMAT)(StreamerModelLoader)
    _collect_metrics()
    _registered = True


def _collect_metrics() -> None:
    """Shows the engine's loads on the server's ``/metrics``.

    vLLM serves ``/metrics`` from its API server's default Prometheus registry, while weights load
    in the engine's processes. The first process to register (the API server, before it starts
    the engine) makes a directory and names it in ``STREAMER_VLLM_METRICS_DIR``, which the
    processes it starts inherit: each writes its ``streamer_*`` series there after a load
    (``options._collected``), and a ``DirectoryCollector`` in the server's registry sums them at
    every scrape. Under ``PROMETHEUS_MULTIPROC_DIR`` vLLM serves that directory instead, where
    the engine's collectors write on their own; the collector here is then not served.
    """
    if os.environ.get(METRICS_DIR_ENV):
        return  # started by a process that collects
    try:
        from prometheus_client import REGISTRY

        from streamer.observe.prometheus import DirectoryCollector
    except ImportError:
        return  # no prometheus-client: loads are not recorded either (a warning says so)
    directory = tempfile.mkdtemp(prefix="streamer-vllm-metrics-")
    owner = os.getpid()
    atexit.register(_remove, directory, owner)
    os.environ[METRICS_DIR_ENV] = directory
    REGISTRY.register(DirectoryCollector(directory))


def _remove(directory: str, owner: int) -> None:
    """The directory, removed at exit by the process that made it (a forked child inherits the hook)."""
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)

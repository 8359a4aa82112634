"""vLLM plugin: ``--load-format streamer`` loads safetensors checkpoints with streamer.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point and calls it in
every process it starts (API server, engine core, workers). Importing this package imports
neither vLLM nor torch; :func:`register` imports vLLM lazily, never touches CUDA, and
registers the loader once per process however often it is called.
"""

from __future__ import annotations

from streamer_vllm.options import KEYS, LoaderOptions, parse_options

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
    _registered = True

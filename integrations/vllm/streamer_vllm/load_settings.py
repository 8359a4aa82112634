"""Which of vLLM's ``LoadConfig`` fields ``--load-format streamer`` honours, and which it refuses.

vLLM-free: the loader passes the fields as a mapping. A field that is not honoured is refused
when it differs from vLLM's default, so no setting is ever silently ignored; a field this plugin
does not know (a newer vLLM) is reported in a warning when it is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streamer.errors import ConfigError

HONOURED: dict[str, str] = {
    "load_format": "selects this loader",
    "download_dir": "where a model id's safetensors are downloaded to or found in the cache",
    "ignore_patterns": "files a model id's download skips, as for the default loader",
    "model_loader_extra_config": (
        "streamer's options: concurrency, block_size, memory_limit, weights, cache_dir, cache_max_bytes"
    ),
    "device": "vLLM builds the model there; streamer reads to the device of its parameters",
    "use_tqdm_on_load": "the progress bar (bytes, GB/s) on the first rank",
}

REFUSED: dict[str, str] = {
    "safetensors_load_strategy": "a strategy of load format 'safetensors'; streamer always reads the "
    "files itself with concurrent block reads",
    "safetensors_prefetch_num_threads": "load format 'safetensors' only; set concurrency in "
    "model_loader_extra_config",
    "safetensors_prefetch_block_size": "load format 'safetensors' only; set block_size in "
    "model_loader_extra_config",
    "pt_load_map_location": "applies to .pt checkpoints; streamer reads safetensors only",
}


def check_load_config(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[str]:
    """Raises ``ConfigError`` for a refused field set away from its default; returns the names of
    unknown fields that are set (for a warning)."""
    for name, why in REFUSED.items():
        if name in values and values[name] != defaults.get(name):
            raise ConfigError(
                f"load format 'streamer' does not support {name}={values[name]!r}: {why}; "
                "leave it at its default"
            )
    known = HONOURED.keys() | REFUSED.keys()
    return sorted(name for name in values if name not in known and values[name] != defaults.get(name))

"""``--model-loader-extra-config`` for ``--load-format streamer``, parsed without vLLM.

Keys (all optional): ``concurrency`` (reader threads), ``block_size`` and ``memory_limit`` (bytes,
as an integer or a size such as ``"16MiB"``; ``memory_limit: null`` means unbounded), and
``weights`` (a local file, directory, ``*.index.json`` or ``s3://`` URI holding the safetensors,
KEYS = ("concurrency", "block_size", "memory_limit", "weights", "distributed", "cache_dir", "cache_max_bytes")
``StreamerConfig``'s defaults (its ``STREAMER_*`` environment variables): an unset
``memory_limit`` is streamer's auto budget, sized from the checkpoint and the free memory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamer.config import UNLIMITED, StreamerConfig, parse_size
from streamer.errors import ConfigError, SourceError

KEYS = ("concurrency", "block_size", "memory_limit", "weights", "distributed", "cache_dir", "cache_max_bytes")
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoaderOptions:
    """What the loader needs: where the weights are (``None``: the model directory) and how to read them."""

    config: StreamerConfig
    weights: str | None = None
    distributed: bool = True  # load through vLLM's TP group when there is one


def _size(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{key} must be a number of bytes or a size such as '16MiB', got {value!r}")
    size = parse_size(value, name=key)
    if size < 1:
        raise ConfigError(f"{key} must be positive, got {value!r}")
    return size


def parse_options(extra: Mapping[str, Any] | None) -> LoaderOptions:
    """Validates the extra config; an unknown key or a bad value is a ``ConfigError`` that says why."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in KEYS)
    if unknown:
        raise ConfigError(
            f"unknown model_loader_extra_config key(s) for load format 'streamer': {', '.join(unknown)}; "
            f"valid keys: {', '.join(KEYS)}"
        )
    changes: dict[str, Any] = {}
    if "concurrency" in extra:
        value = extra["concurrency"]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"concurrency must be an integer, got {value!r}")
        changes["concurrency"] = value
    if "block_size" in extra:
        changes["block_size"] = _size("block_size", extra["block_size"])
    if "memory_limit" in extra:
        value = extra["memory_limit"]
        changes["memory_limit"] = UNLIMITED if value is None else _size("memory_limit", value)
    cache = StreamerConfig().cache
    if "cache_dir" in extra:
        value = extra["cache_dir"]
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"cache_dir must be a directory, got {value!r}")
        cache = dataclasses.replace(cache, dir=value)
    if "cache_max_bytes" in extra:
        cache = dataclasses.replace(cache, max_bytes=_size("cache_max_bytes", extra["cache_max_bytes"]))
    changes["cache"] = cache
    weights = extra.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights.strip()):
        raise ConfigError(f"weights must be a path or an s3:// URI, got {weights!r}")
    distributed = extra.get("distributed", True)
    if not isinstance(distributed, bool):
        raise ConfigError(f"distributed must be true or false, got {distributed!r}")
    config = dataclasses.replace(StreamerConfig(), **changes)  # __post_init__ checks the ranges
    return LoaderOptions(config=config, weights=weights, distributed=distributed)


def is_remote(location: str) -> bool:
    return location.startswith("s3://")


def weights_source(options: LoaderOptions, model: str) -> str:
    """What streamer reads: ``weights`` when given, else the model directory.

    A local directory with an HF index is read through the index, so stray ``*.safetensors``
    files beside it (e.g. a ``consolidated.safetensors`` duplicate) are not loaded twice.
    Remote URIs are passed to streamer unchanged.
    """
    location = options.weights if options.weights is not None else model
    if is_remote(location):
        return location
    path = Path(os.path.expanduser(location))
    if not path.exists():
        what = "weights" if options.weights is not None else "the model"
        hint = (
            ""
            if options.weights is not None
            else (
                "; load format 'streamer' reads local directories: give one, or name the safetensors "
                'with model_loader_extra_config {"weights": ...}'
            )
        )
        raise SourceError(f"{what} {location!r} is not a local path{hint}", path=location)
    if path.is_dir() and (path / INDEX_NAME).is_file():
        return str(path / INDEX_NAME)
    return str(path)

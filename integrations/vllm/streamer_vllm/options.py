"""``--model-loader-extra-config`` for ``--load-format streamer``, parsed without vLLM.

Keys (all optional): ``concurrency`` (reader threads), ``block_size`` and ``memory_limit`` (bytes,
as an integer or a size such as ``"16MiB"``; ``memory_limit: null`` means unbounded), ``weights``
(a local file, directory, ``*.index.json``, ``s3://``, ``gs://`` or ``az://`` URI holding the
safetensors, when they are not in the model's directory), ``distributed`` (load through vLLM's
tensor-parallel group, default true; without it a rank reads its tensor-parallel slices),
``cache_dir`` and ``cache_max_bytes`` (the node cache in front of object storage), ``metrics``
(record the load in Prometheus, default true: vLLM's ``/metrics`` shows it), ``presharded``
(remote weights are each rank's own files, as vLLM's ``sharded_state`` writes them; a local
directory of such files is found without it), ``ep_weight_filter`` (under expert
parallelism, read only this rank's experts; default true), ``parent_cpus`` (a CPU load's threads
on the CPUs of the process that started the worker, not only the worker's pinned OpenMP cores;
default true) and ``prefault`` (a first CPU load faults the model's parameters in on a thread
of its own, ahead of vLLM's copies; default true). What is not given keeps
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

from streamer.config import UNLIMITED, StreamerConfig
from streamer.errors import ConfigError, SourceError

KEYS = (
    "concurrency",
    "block_size",
    "memory_limit",
    "weights",
    "distributed",
    "cache_dir",
    "cache_max_bytes",
    "metrics",
    "presharded",
    "ep_weight_filter",
    "parent_cpus",
    "prefault",
)
METRICS_DIR_ENV = "STREAMER_VLLM_METRICS_DIR"  # where the engine's processes leave their series
_CACHE_KEYS = {"cache_dir": "dir", "cache_max_bytes": "max_bytes"}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoaderOptions:
    """What the loader needs: where the weights are (``None``: the model directory) and how to read them."""

    config: StreamerConfig
    weights: str | None = None
    distributed: bool = True  # load through vLLM's TP group when there is one
    presharded: bool = False  # the weights are each rank's own files (found for local directories)
    ep_weight_filter: bool = True  # under expert parallelism, other ranks' experts are not read
    parent_cpus: bool = True  # a CPU load's threads on the parent process's CPUs (affinity.py)
    prefault: bool = True  # a first CPU load faults the parameters in beside it (prefault.py)


def parse_options(extra: Mapping[str, Any] | None) -> LoaderOptions:
    """Validates the extra config; an unknown key or a bad value is a ``ConfigError`` that says why.

    Values are parsed by ``StreamerConfig``'s own parsers, as its constructor and environment
    variables are (``"16MiB"`` or ``16777216``, ``"4"`` or ``4``)."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in KEYS)
    if unknown:
        raise ConfigError(
            f"unknown model_loader_extra_config key(s) for load format 'streamer': {', '.join(unknown)}; "
            f"valid keys: {', '.join(KEYS)}"
        )
    changes: dict[str, Any] = {key: extra[key] for key in ("concurrency", "block_size") if key in extra}
    if "memory_limit" in extra:
        value = extra["memory_limit"]
        changes["memory_limit"] = UNLIMITED if value is None else value  # null: unbounded, as before
    defaults = StreamerConfig()
    cache = {field: extra[key] for key, field in _CACHE_KEYS.items() if key in extra}
    changes["cache"] = dataclasses.replace(defaults.cache, **cache)
    weights = extra.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights.strip()):
        raise ConfigError(f"weights must be a path or an s3://, gs:// or az:// URI, got {weights!r}")
    switch_defaults = {"distributed": True, "presharded": False, "ep_weight_filter": True}
    switch_defaults |= {"parent_cpus": True, "prefault": True}
    switches = {key: extra.get(key, default) for key, default in switch_defaults.items()}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    changes["metrics"] = extra.get("metrics", defaults.metrics if "STREAMER_METRICS" in os.environ else True)
    config = dataclasses.replace(defaults, **changes)  # __post_init__ parses every value
    return LoaderOptions(config=_collected(config), weights=weights, **switches)


def _collected(config: StreamerConfig) -> StreamerConfig:
    """``config`` writing this process's series where vLLM's server collects them (``register``
    names the directory), when metrics are on: under vLLM they are unless ``metrics: false`` or
    ``STREAMER_METRICS`` says otherwise."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if not config.metrics or not directory or config.metrics_textfile is not None:
        return config
    return dataclasses.replace(config, metrics_textfile=os.path.join(directory, "streamer-{pid}.prom"))


REMOTE_SCHEMES = ("s3://", "gs://", "az://", "https://")  # https: Azure Blob's portal URLs


def is_remote(location: str) -> bool:
    return location.startswith(REMOTE_SCHEMES)


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

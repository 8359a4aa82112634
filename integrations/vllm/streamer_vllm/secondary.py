"""The checkpoints besides the model's own that a vLLM model loads, found as vLLM finds them.

A model may list ``secondary_weights`` (vLLM's ``DefaultModelLoader.Source``: another repo or a
subfolder, loaded under a name prefix, e.g. Ultravox's audio and text towers or BGE-M3's heads)
and define ``is_unused_checkpoint_weight`` (an MTP draft that loads a few layers of a large
checkpoint). The default load format honours both; so does this one: a secondary source is
resolved by vLLM's own file rules (hub download, subfolder, patterns, index), streamed by
streamer when it is safetensors and read by vLLM's default loader when it is not (``.pt`` or
``.bin`` heads). Imports vLLM: used only by the loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from streamer.backends.sources import SourceLike
from streamer.plan.checkpoint import Checkpoint
from streamer_vllm.options import is_remote

UnusedFilter = Callable[[str], bool]


@dataclass(frozen=True)
class StreamedSource:
    """Safetensors that streamer reads; each name is yielded under ``prefix``."""

    source: SourceLike
    prefix: str = ""
    is_unused: UnusedFilter | None = None
    shared: bool = True  # every rank reads these same files, so a group load may split them


@dataclass(frozen=True)
class DelegatedSource:
    """A source that is not safetensors: vLLM's default loader reads it (the prefix is its own)."""

    loader: DefaultModelLoader
    source: Any  # DefaultModelLoader.Source


WeightSource = StreamedSource | DelegatedSource


def secondary_sources(model: object, load_config: LoadConfig) -> list[WeightSource]:
    """``model.secondary_weights``, each resolved to what reads it."""
    extras: Sequence[Any] = getattr(model, "secondary_weights", ()) or ()
    if not extras:
        return []
    # vLLM's file rules for load format "auto" (safetensors, else .bin, else .pt), with the
    # caller's download directory and ignore patterns; the plugin's own extra config is not for it.
    default = DefaultModelLoader(
        dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})
    )
    return [_resolve(extra, default) for extra in extras]


def _resolve(extra: Any, default: DefaultModelLoader) -> WeightSource:
    location: str = extra.model_or_path
    unused: UnusedFilter | None = getattr(extra, "is_unused_weight", None)
    if is_remote(location):
        uri = f"{location.rstrip('/')}/{extra.subfolder.strip('/')}/" if extra.subfolder else location
        return StreamedSource(uri, extra.prefix, unused)
    _, files, use_safetensors, _ = default._prepare_weights(
        location, extra.subfolder, extra.revision, extra.fall_back_to_pt, extra.allow_patterns_overrides
    )
    if use_safetensors:
        return StreamedSource(sorted(files), extra.prefix, unused)
    return DelegatedSource(default, extra)


def delegated_weights(source: DelegatedSource) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a non-safetensors source, as the default load format yields them."""
    yield from source.loader._get_weights_iterator(source.source)


def files_in_use(checkpoint: Checkpoint, is_unused: UnusedFilter) -> list[str] | None:
    """The files holding a tensor the model loads, when that leaves out some (else None).

    vLLM's rule, so both load formats read the same shards: a shard is skipped only when the
    model loads none of its tensors, and if that would skip every shard, none is skipped.
    """
    kept = [h.path for h in checkpoint.headers if not all(is_unused(t.name) for t in h.tensors)]
    return kept if kept and len(kept) < len(checkpoint.headers) else None

"""Model ids (``Qwen/Qwen2.5-7B``): fetched exactly as vLLM's default loader fetches safetensors.

Imports vLLM: used only by the loader, once vLLM runs. vLLM's own download helpers are called
with the same arguments the default loader passes (``revision``, ``download_dir``,
``ignore_patterns``, the model's ``allow_patterns_overrides``), so an id, a revision and a cache
behave the same for both load formats, online or with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import glob
import os

from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.weight_utils import (
    download_safetensors_index_file_from_hf,
    download_weights_from_hf,
)

from streamer.errors import SourceError
from streamer_vllm.options import INDEX_NAME

SAFETENSORS_PATTERN = "*.safetensors"


def fetch_from_hub(
    model: str,
    revision: str | None,
    load_config: LoadConfig,
    allow_patterns_overrides: list[str] | None = None,
) -> str | list[str]:
    """The local snapshot directory holding ``model``'s safetensors (and index, if it has one),
    downloaded into vLLM's cache if need be; with ``allow_patterns_overrides``, the matching
    files themselves (the default loader then skips the index, and so does this).

    Any failure (no such repo or revision, hub unreachable and nothing cached) is a
    ``SourceError`` naming the id and revision.
    """
    patterns = allow_patterns_overrides or [SAFETENSORS_PATTERN]
    try:
        folder: str = download_weights_from_hf(
            model,
            load_config.download_dir,
            patterns,
            revision,
            ignore_patterns=load_config.ignore_patterns,
        )
        if allow_patterns_overrides is None:
            download_safetensors_index_file_from_hf(
                model, INDEX_NAME, cache_dir=load_config.download_dir, revision=revision
            )
    except (OSError, ValueError) as exc:  # huggingface_hub's errors derive from these
        raise SourceError(
            f"the model {model!r} (revision {revision or 'main'}) is neither a local path nor "
            f"fetchable from the Hugging Face hub or its cache: {_first_line(exc)}",
            path=model,
        ) from exc
    if allow_patterns_overrides is None:
        return folder
    files = sorted({path for pattern in patterns for path in glob.glob(os.path.join(folder, pattern))})
    if not files:
        raise SourceError(f"no files match {patterns} in the snapshot of {model!r}", path=folder)
    return files


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

"""The optional dependencies of s3:// and gs:// sources, checked where they are first needed.

S3 is the ``[s3]`` extra (aiobotocore, which brings botocore and aiohttp), not a dependency: a
local-only install stays free of aiobotocore's narrow botocore pins. Opening an ``s3://`` source
without it must say what to install, not fail deep inside with a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib

from streamer.errors import ConfigError

S3_MODULES = ("aiobotocore", "botocore", "aiohttp")
S3_INSTALL = "pip install 'streamer-weights[s3]'"
GCS_MODULES = ("aiohttp", "google.auth", "requests")
GCS_INSTALL = "pip install 'streamer-weights[gcs]'"
AZURE_MODULES = ("aiohttp", "azure.identity", "azure.storage.blob")
AZURE_INSTALL = "pip install 'streamer-weights[azure]'"


def require_s3() -> None:
    """Imports what S3 reads need; ``ConfigError`` naming the pip command if one is missing."""
    _require(S3_MODULES, "s3://", "S3", S3_INSTALL)


def require_gcs() -> None:
    """Imports what GCS reads need; ``ConfigError`` naming the pip command if one is missing."""
    _require(GCS_MODULES, "gs://", "GCS", GCS_INSTALL)


def require_azure() -> None:
    """Imports what Azure Blob reads need; ``ConfigError`` naming the pip command if one is missing."""
    _require(AZURE_MODULES, "Azure Blob", "Azure", AZURE_INSTALL)


def _require(modules: tuple[str, ...], scheme: str, extra: str, install: str) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = exc.name or name
            break
    else:
        return
    raise ConfigError(
        f"reading {scheme} sources needs the {extra} extra ({missing!r} does not import): {install}"
    )


def require_cache() -> None:
    """The cache checksums every block with xxhash (in the ``[s3]`` extra); ``ConfigError`` without it."""
    try:
        importlib.import_module("xxhash")
    except ImportError:
        pass  # raised below, outside the handler, so the error carries no import traceback
    else:
        return
    raise ConfigError(f"the local cache (StreamerConfig.cache) needs 'xxhash': {S3_INSTALL}")

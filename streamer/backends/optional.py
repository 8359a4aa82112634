"""The optional dependencies of s3:// and gs:// sources, checked where they are first needed.

Each cloud is an extra, not a dependency (S3: botocore, for boto3's credential chain, needed
unless the credentials are explicit or in the environment, or access anonymous; GCS:
google-auth; Azure: azure-identity and the SDK's SAS helper): a local-only install stays free of
them. Opening a source without its extra must say what to install, not fail deep inside with a
bare ``ModuleNotFoundError``. Only whether they are installed is checked here (not imported: an
S3 load with explicit or environment credentials never imports botocore).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from streamer.errors import ConfigError

S3_MODULES = ("botocore",)
S3_INSTALL = "pip install 'streamer-weights[s3]'"
GCS_MODULES = ("google.auth", "requests")
GCS_INSTALL = "pip install 'streamer-weights[gcs]'"
AZURE_MODULES = ("azure.identity", "azure.storage.blob")
AZURE_INSTALL = "pip install 'streamer-weights[azure]'"


def require_s3() -> None:
    """``ConfigError`` naming the pip command where what S3 reads need is not installed."""
    _require(S3_MODULES, "s3://", "S3", S3_INSTALL)


def require_gcs() -> None:
    """``ConfigError`` naming the pip command where what GCS reads need is not installed."""
    _require(GCS_MODULES, "gs://", "GCS", GCS_INSTALL)


def require_azure() -> None:
    """``ConfigError`` naming the pip command where what Azure Blob reads need is not installed."""
    _require(AZURE_MODULES, "Azure Blob", "Azure", AZURE_INSTALL)


def _require(modules: tuple[str, ...], scheme: str, extra: str, install: str) -> None:
    for name in modules:
        try:
            # sys.modules first: imported already (maybe before a privilege drop), or blocked (None)
            found = sys.modules[name] is not None if name in sys.modules else _installed(name)
        except ImportError as exc:
            missing = exc.name or name
            break
        if not found:
            missing = name
            break
    else:
        return
    raise ConfigError(
        f"reading {scheme} sources needs the {extra} extra ({missing!r} does not import): {install}"
    )


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ValueError:  # a parent package imported without a spec
        return False


def require_cache() -> None:
    """The cache checksums every block with xxhash (in the ``[s3]`` extra); ``ConfigError`` without it."""
    try:
        importlib.import_module("xxhash")
    except ImportError:
        pass  # raised below, outside the handler, so the error carries no import traceback
    else:
        return
    raise ConfigError(f"the local cache (StreamerConfig.cache) needs 'xxhash': {S3_INSTALL}")

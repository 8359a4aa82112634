"""The optional dependencies of s3:// sources, checked where they are first needed.

S3 is the ``[s3]`` extra (aiobotocore, which brings botocore and aiohttp), not a dependency: a
local-only install stays free of aiobotocore's narrow botocore pins. Opening an ``s3://`` source
without it must say what to install, not fail deep inside with a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib

from streamer.errors import ConfigError

S3_MODULES = ("aiobotocore", "botocore", "aiohttp")
S3_INSTALL = "pip install 'streamer-weights[s3]'"


def require_s3() -> None:
    """Imports what S3 reads need; ``ConfigError`` naming the pip command if one is missing."""
    for name in S3_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            missing = exc.name or name
            break
    else:
        return
    raise ConfigError(f"reading s3:// sources needs the S3 extra ({missing!r} does not import): {S3_INSTALL}")


def require_cache() -> None:
    """The cache checksums every block with xxhash (in the ``[s3]`` extra); ``ConfigError`` without it."""
    try:
        importlib.import_module("xxhash")
    except ImportError:
        pass  # raised below, outside the handler, so the error carries no import traceback
    else:
        return
    raise ConfigError(f"the local cache (StreamerConfig.cache) needs 'xxhash': {S3_INSTALL}")

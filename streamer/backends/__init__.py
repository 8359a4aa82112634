"""Where checkpoints live: one ``Storage`` per place (``base.py``), chosen by the source's scheme.

A plain path is a local file (``local.py``); ``s3://`` is S3 (``s3/``), ``gs://`` Google Cloud
Storage (``gcs/``), ``az://`` and portal URLs Azure Blob (``azure/``), all on the shared
object-store client (``http/``); another storage registers
its scheme with ``register`` (one module: the storage, its feed, its resolution).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamer.backends.base import Storage
from streamer.backends.local import LocalStorage
from streamer.backends.optional import require_cache
from streamer.backends.sources import SourceLike, uri_scheme
from streamer.config import StreamerConfig
from streamer.errors import SourceError

if TYPE_CHECKING:
    from streamer.backends.http.storage import ObjectStorage

Factory = Callable[[StreamerConfig], Storage]


def _s3(config: StreamerConfig) -> Storage:
    from streamer.backends.s3.storage import S3Storage

    return _cached(S3Storage(config.s3), config)


def _gcs(config: StreamerConfig) -> Storage:
    from streamer.backends.gcs.storage import GcsStorage  # google-auth only then

    return _cached(GcsStorage(config.gcs), config)


def _azure(config: StreamerConfig) -> Storage:
    from streamer.backends.azure.storage import AzureStorage  # the Azure SDK only then

    return _cached(AzureStorage(config.azure), config)


def _cached(storage: ObjectStorage[Any], config: StreamerConfig) -> Storage:
    """``storage`` behind the node's cache, where ``StreamerConfig.cache`` names a usable one."""
    if config.cache.dir is None:
        return storage
    require_cache()
    from streamer.backends.cache.storage import CachedObjectStorage, usable_directory  # xxhash only then

    if not usable_directory(config.cache):
        return storage
    return CachedObjectStorage(storage, config.cache)


# https:// is Azure's portal form (https://<account>.blob.core.windows.net/...); other hosts are refused.
_FACTORIES: dict[str, Factory] = {"s3": _s3, "gs": _gcs, "az": _azure, "https": _azure}


def register(scheme: str, factory: Factory) -> None:
    """Sources ``<scheme>://...`` are opened by ``factory(config)`` from now on."""
    _FACTORIES[scheme] = factory


def unregister(scheme: str) -> None:
    _FACTORIES.pop(scheme, None)


def scheme_of(source: SourceLike) -> str | None:
    """The URI scheme ``source`` names (``None``: local files); a list mixing places is refused."""
    if isinstance(source, (str, os.PathLike)):
        return uri_scheme(os.fspath(source))
    schemes = {scheme_of(item) for item in source}
    if len(schemes) > 1:
        raise SourceError(
            "a checkpoint's files must be in one place (all local or all on S3 or all on one other store), "
            "not a mix"
        )
    return schemes.pop() if schemes else None


def open_storage(source: SourceLike, config: StreamerConfig) -> Storage:
    """The storage session that reads ``source`` (not yet connected: that happens on first use)."""
    scheme = scheme_of(source)
    if scheme is None:
        return LocalStorage(config)
    factory = _FACTORIES.get(scheme)
    if factory is None:
        known = ", ".join(f"{name}://" for name in sorted(_FACTORIES))
        raise SourceError(
            f"no storage for {scheme}:// sources (known: {known}, and local paths)",
            path=os.fspath(source) if isinstance(source, (str, os.PathLike)) else None,
        )
    return factory(config)

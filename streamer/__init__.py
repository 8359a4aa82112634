"""streamer: load safetensors checkpoints from storage into memory at the speed of the hardware."""

from typing import TYPE_CHECKING

from streamer._version import __version__
from streamer.api import IncompatibleKeys, Streamer, load, load_file, load_into, open
from streamer.config import AzureConfig, CacheConfig, GCSConfig, S3Config, StreamerConfig
from streamer.errors import (
    ConfigError,
    DeviceError,
    FileClosedError,
    HeaderError,
    KeyMismatchError,
    MissingFileError,
    MissingTensorError,
    ObjectMissingError,
    ObjectSourceError,
    ObjectStoreError,
    PackedSliceError,
    ReadError,
    S3Error,
    S3MissingError,
    S3SourceError,
    SourceError,
    SourceTypeError,
    StreamerError,
    TruncatedFileError,
)

__all__ = [
    "AzureConfig",
    "CacheConfig",
    "ConfigError",
    "DeviceError",
    "FileClosedError",
    "GCSConfig",
    "HeaderError",
    "IncompatibleKeys",
    "KeyMismatchError",
    "MissingFileError",
    "MissingTensorError",
    "ObjectMissingError",
    "ObjectSourceError",
    "ObjectStoreError",
    "PackedSliceError",
    "ReadError",
    "S3Config",
    "S3Error",
    "S3MissingError",
    "S3SourceError",
    "SourceError",
    "SourceTypeError",
    "Streamer",
    "StreamerConfig",
    "StreamerError",
    "TensorSlice",
    "TruncatedFileError",
    "__version__",
    "load",
    "load_file",
    "load_into",
    "open",
    "safe_open",
]

if TYPE_CHECKING:
    from streamer.dropin import TensorSlice, safe_open

_DROPIN = frozenset({"TensorSlice", "safe_open"})


def __getattr__(name: str) -> object:
    """The drop-in ``safe_open``, imported at first use: a load does not need it."""
    if name in _DROPIN:
        from streamer import dropin

        return getattr(dropin, name)
    raise AttributeError(f"module 'streamer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_DROPIN})

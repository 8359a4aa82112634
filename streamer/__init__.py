"""streamer: load safetensors checkpoints from storage into memory at the speed of the hardware."""

from streamer._version import __version__
from streamer.api import IncompatibleKeys, Streamer, load, load_file, load_into, open
from streamer.config import CacheConfig, S3Config, StreamerConfig
from streamer.dropin import TensorSlice, safe_open
from streamer.errors import (
    ConfigError,
    DeviceError,
    FileClosedError,
    HeaderError,
    KeyMismatchError,
    MissingFileError,
    MissingTensorError,
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
    "CacheConfig",
    "ConfigError",
    "DeviceError",
    "FileClosedError",
    "HeaderError",
    "IncompatibleKeys",
    "KeyMismatchError",
    "MissingFileError",
    "MissingTensorError",
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

"""streamer: load safetensors checkpoints from storage into memory at the speed of the hardware."""

from streamer._version import __version__
from streamer.api import IncompatibleKeys, Streamer, load, load_file, load_into, open
from streamer.config import S3Config, StreamerConfig
from streamer.errors import (
    ConfigError,
    DeviceError,
    HeaderError,
    ReadError,
    S3Error,
    S3SourceError,
    SourceError,
    StreamerError,
    TruncatedFileError,
)

__all__ = [
    "ConfigError",
    "DeviceError",
    "HeaderError",
    "IncompatibleKeys",
    "ReadError",
    "S3Config",
    "S3Error",
    "S3SourceError",
    "SourceError",
    "Streamer",
    "StreamerConfig",
    "StreamerError",
    "TruncatedFileError",
    "__version__",
    "load",
    "load_file",
    "load_into",
    "open",
]

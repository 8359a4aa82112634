"""streamer: load safetensors checkpoints from storage into memory at the speed of the hardware."""

from streamer.api import IncompatibleKeys, Streamer, load, load_file, load_into, open
from streamer.config import StreamerConfig
from streamer.errors import (
    ConfigError,
    DeviceError,
    HeaderError,
    ReadError,
    SourceError,
    StreamerError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DeviceError",
    "HeaderError",
    "IncompatibleKeys",
    "ReadError",
    "SourceError",
    "Streamer",
    "StreamerConfig",
    "StreamerError",
    "__version__",
    "load",
    "load_file",
    "load_into",
    "open",
]

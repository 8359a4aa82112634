"""One exception hierarchy for everything streamer raises on purpose.

Every error carries the file (``path``) and, where it applies, the tensor
(``tensor``) it is about, so a failure in a 300-shard checkpoint points at the
exact place without a debugger.
"""

from __future__ import annotations


class StreamerError(Exception):
    """Root of every error streamer raises deliberately."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        self.path = path
        self.tensor = tensor
        self.reason = message
        where = []
        if path is not None:
            where.append(f"file {path!r}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class ConfigError(StreamerError, ValueError):
    """A configuration value or argument is invalid."""


class SourceError(StreamerError):
    """The source cannot be resolved: missing file, bad index, duplicate tensor names, …"""


class HeaderError(StreamerError):
    """A safetensors header is malformed or violates the format's invariants."""


class ReadError(StreamerError):
    """Reading tensor bytes failed: an I/O error, or the file is shorter than its header says."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        tensor: str | None = None,
        offset: int | None = None,
    ) -> None:
        self.offset = offset
        if offset is not None:
            message = f"{message} at byte {offset}"
        super().__init__(message, path=path, tensor=tensor)


class DeviceError(StreamerError):
    """The requested destination device is unknown or unavailable."""

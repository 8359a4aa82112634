"""One exception hierarchy for everything streamer raises on purpose.

Every error carries the file (``path``) and, where it applies, the tensor
(``tensor``) it is about, so a failure in a 300-shard checkpoint points at the
exact place without a debugger.
"""

from __future__ import annotations

from collections.abc import Sequence


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


class SourceTypeError(ConfigError, TypeError):
    """The source is not a path, a URI or a list of them: also a ``TypeError``, as ``open()`` raises."""


class MissingFileError(SourceError, FileNotFoundError):
    """The file does not exist: also a ``FileNotFoundError``, which code written for
    ``safetensors`` catches."""


class MissingTensorError(SourceError, KeyError):
    """No tensor of that name: also a ``KeyError``, as a lookup by name fails in a dict."""

    def __str__(self) -> str:
        return Exception.__str__(self)  # KeyError's own quotes the whole message


class KeyMismatchError(SourceError):
    """``load_into(strict=True)``: names the destination and the checkpoint do not share, both ways
    at once (as ``torch.nn.Module.load_state_dict`` reports them)."""

    def __init__(
        self, missing_keys: list[str], unexpected_keys: list[str], *, paths: tuple[str, ...]
    ) -> None:
        self.missing_keys = missing_keys  # in dest, not in the checkpoint
        self.unexpected_keys = unexpected_keys  # in the checkpoint, not in dest
        parts = []
        if missing_keys:
            parts.append(f"missing from the checkpoint ({len(missing_keys)}): {listed(missing_keys)}")
        if unexpected_keys:
            parts.append(f"not in dest ({len(unexpected_keys)}): {listed(unexpected_keys)}")
        where = paths[0] if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more file(s)"
        super().__init__(
            "dest and the checkpoint name different tensors (strict=False loads those both have): "
            + "; ".join(parts),
            path=where,
            tensor=(missing_keys or unexpected_keys)[0],
        )


def listed(names: Sequence[str], *, quoted: bool = True, shown: int = 10) -> str:
    """``names`` for a message: the first ``shown``, then how many more."""
    first = ", ".join(repr(name) if quoted else name for name in names[:shown])
    return first + (f" and {len(names) - shown} more" if len(names) > shown else "")


class FileClosedError(StreamerError, ValueError):
    """The ``safe_open`` handle was closed; a ``ValueError`` like I/O on a closed Python file."""


class PackedSliceError(StreamerError, RuntimeError):
    """A slice that cuts a byte of a packed dtype (``F4``: two values per byte) in two.

    A ``RuntimeError``, which is what ``safetensors`` raises for every slice of such a tensor."""


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


class TruncatedFileError(HeaderError, ReadError):
    """The file is shorter than its header says: both a malformed file and a failed read, so code
    that catches either one catches it."""


class DeviceError(StreamerError):
    """The requested destination device is unknown or unavailable."""


class ObjectStoreError(ReadError):
    """An object-store request (S3, GCS) failed for good: after its retries, or at once for a
    permanent error (403, 404, a changed object). Names the object, the byte range, the HTTP status
    and the tries; never a credential."""

    scheme = "object"  # what the object's URI starts with, before ``://``

    def __init__(
        self,
        message: str,
        *,
        bucket: str,
        key: str,
        byte_range: tuple[int, int] | None = None,
        status: int | None = None,
        code: str | None = None,
        attempts: int = 1,
        tensor: str | None = None,
        scheme: str | None = None,
    ) -> None:
        if scheme is not None:
            self.scheme = scheme
        self.bucket = bucket
        self.key = key
        self.byte_range = byte_range  # [begin, end) of the object
        self.status = status
        self.code = code
        self.attempts = attempts
        details = []
        if byte_range is not None:
            details.append(f"bytes {byte_range[0]}-{byte_range[1] - 1}")
        if status is not None:
            details.append(f"HTTP {status}" + (f" {code}" if code and code != str(status) else ""))
        elif code:
            details.append(code)
        details.append(f"{attempts} attempt{'s' if attempts != 1 else ''}")
        super().__init__(
            f"{message} [{', '.join(details)}]",
            path=f"{self.scheme}://{bucket}/{key}",
            tensor=tensor,
            offset=None,
        )


class ObjectSourceError(SourceError, ObjectStoreError):
    """The bucket, object or prefix does not exist or access is denied (403, 404, empty prefix)."""


class ObjectMissingError(ObjectSourceError, FileNotFoundError):
    """The bucket or object does not exist (404): also a ``FileNotFoundError``, as a missing local
    file is."""


class S3Error(ObjectStoreError):
    """An S3 request failed for good (see ``ObjectStoreError``)."""

    scheme = "s3"


class S3SourceError(ObjectSourceError, S3Error):
    """The bucket, object or prefix does not exist or access is denied (403, 404, empty prefix)."""


class S3MissingError(S3SourceError, ObjectMissingError):
    """The bucket or object does not exist (404): also a ``FileNotFoundError``, as a missing local
    file is."""

"""S3 URIs (``s3://bucket/key``) and the objects they name, as their header reads saw them."""

from __future__ import annotations

from dataclasses import dataclass

from streamer.errors import SourceError

SCHEME = "s3://"


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def parse_uri(text: str) -> S3Uri:
    """``s3://bucket/key`` (the key may be empty or end with ``/`` for a prefix)."""
    if not text.startswith(SCHEME):
        raise SourceError("not an S3 URI (expected s3://bucket/key)", path=text)
    bucket, _, key = text[len(SCHEME) :].partition("/")
    if not bucket or any(c in bucket for c in " \\?#") or bucket in (".", ".."):
        raise SourceError("bad S3 URI: no valid bucket name (expected s3://bucket/key)", path=text)
    if "\0" in key:
        raise SourceError("bad S3 URI: the key contains a NUL byte", path=text)
    return S3Uri(bucket, key)


@dataclass(frozen=True)
class ObjectInfo:
    """An object as its header read saw it; later reads must see the same size and ETag."""

    uri: S3Uri
    size: int
    etag: str | None

    @property
    def path(self) -> str:
        """The object's URI: what ``FileHeader.path`` and errors call it."""
        return str(self.uri)

"""S3 URIs (``s3://bucket/key``) and the objects they name, as their header reads saw them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from streamer.backends.http.objects import ObjectUri, StoredObject


@dataclass(frozen=True)
class S3Uri(ObjectUri):
    scheme: ClassVar[str] = "s3"
    label: ClassVar[str] = "S3"


def parse_uri(text: str) -> S3Uri:
    """``s3://bucket/key`` (the key may be empty or end with ``/`` for a prefix)."""
    uri = S3Uri.parse(text)
    assert isinstance(uri, S3Uri)
    return uri


@dataclass(frozen=True)
class ObjectInfo(StoredObject):
    """An S3 object as its header read saw it: its version is its ETag."""

    @property
    def etag(self) -> str | None:
        return self.version

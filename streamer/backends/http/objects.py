"""Objects of a bucket store, named and pinned: ``<scheme>://bucket/key``, and an object as its
header read saw it (size and version), which every later read must see too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from streamer.errors import SourceError


@dataclass(frozen=True)
class ObjectUri:
    """A key in a bucket; each store's subclass names its scheme."""

    bucket: str
    key: str

    scheme: ClassVar[str] = ""
    label: ClassVar[str] = ""  # what messages call the store

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    @classmethod
    def parse(cls, text: str) -> ObjectUri:
        """``<scheme>://bucket/key`` (the key may be empty or end with ``/`` for a prefix)."""
        prefix = f"{cls.scheme}://"
        example = f"{prefix}bucket/key"
        if not text.startswith(prefix):
            raise SourceError(f"not a URI of {cls.label} (expected {example})", path=text)
        bucket, _, key = text[len(prefix) :].partition("/")
        if not bucket or any(c in bucket for c in " \\?#") or bucket in (".", ".."):
            raise SourceError(f"bad {cls.label} URI: no valid bucket name (expected {example})", path=text)
        if "\0" in key:
            raise SourceError(f"bad {cls.label} URI: the key contains a NUL byte", path=text)
        return cls(bucket, key)


@dataclass(frozen=True)
class StoredObject:
    """An object as its header read saw it; later reads must see the same size and version (an
    ETag on S3, a generation on GCS; None where the server gave none)."""

    uri: ObjectUri
    size: int
    version: str | None

    @property
    def path(self) -> str:
        """The object's URI: what ``FileHeader.path`` and errors call it."""
        return str(self.uri)

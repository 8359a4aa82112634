"""GCS URIs (``gs://bucket/key``) and the objects they name, pinned to a generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import quote

from streamer.backends.http.objects import ObjectUri, StoredObject


@dataclass(frozen=True)
class GcsUri(ObjectUri):
    scheme: ClassVar[str] = "gs"
    label: ClassVar[str] = "GCS"

    @property
    def bucket_path(self) -> str:
        """The bucket's objects in the JSON API (the name percent-encoded whole)."""
        return f"/storage/v1/b/{quote(self.bucket, safe='')}/o"

    @property
    def object_path(self) -> str:
        """The object's path in the JSON API (name and bucket percent-encoded whole)."""
        return f"{self.bucket_path}/{quote(self.key, safe='')}"


@dataclass(frozen=True)
class GcsObject(StoredObject):
    """A GCS object as its header read saw it: its version is its generation; ``crc32c`` is GCS's
    checksum of the whole object, where the answer named it (not part of the object's identity:
    the generation fixes it)."""

    crc32c: int | None = field(default=None, compare=False)

"""Which files a ``--source`` means, resolved by ``streamer``'s own source resolution.

Local and remote sources (``s3://``, ``gs://``, ``az://`` or Azure's portal URLs) alike go through
``streamer.plan.checkpoint.open_checkpoint`` (list the directory or prefix or read the index, then
read and validate every header), so the files, their sizes and the tensor totals are the ones the
loaders see, and a checkpoint streamer refuses is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class SourceProblem(Exception):
    """The source cannot be benchmarked (missing, empty, not safetensors)."""


class SourceUnreachable(Exception):
    """A remote source could not be read for reasons other than the source itself (network, client)."""


@dataclass(frozen=True)
class CheckpointFiles:
    """What every loader is pointed at: the original source and its shard files."""

    source: str  # what streamer receives (a file, a directory, an index, or a remote URI of one)
    files: list[Path]  # local sources: what the peers receive, and what gets evicted / warmed
    tensor_bytes: int
    tensor_count: int
    objects: dict[str, int] = field(default_factory=dict)  # remote sources: each shard's URI and size

    @property
    def remote(self) -> bool:
        return is_remote(self.source)

    @property
    def scheme(self) -> str | None:
        """The remote store (``s3``, ``gs``, ``az``); None for local files."""
        return remote_scheme(self.source)

    @property
    def shards(self) -> dict[str, int]:
        """What the peers receive (paths or URIs), in order, with each one's size in bytes."""
        return dict(self.objects) if self.remote else {str(f): f.stat().st_size for f in self.files}


REMOTE_FORMS = (
    "s3://bucket/key, gs://bucket/key, az://container/key or https://<account>.blob.core.windows.net/…"
)


def is_remote(source: str) -> bool:
    return "://" in source


def remote_scheme(source: str) -> str | None:
    """``s3``, ``gs`` or ``az`` (Azure's portal URLs too) for a remote source; None for a local one;
    ``SourceProblem`` for another scheme."""
    if not is_remote(source):
        return None
    scheme = source.partition("://")[0]
    if scheme == "https" and ".blob.core.windows.net/" in source:
        return "az"
    if scheme not in ("s3", "gs", "az"):
        raise SourceProblem(f"{source}: remote sources are {REMOTE_FORMS}")
    return scheme


def resolve(source: str) -> CheckpointFiles:
    """A file, a directory (every ``*.safetensors``) or a ``*.index.json`` (the shards it names),
    local or remote, resolved and its headers validated by ``streamer`` itself."""
    remote = remote_scheme(source) is not None
    # Imported here: the timed children import this module, and must not import streamer early.
    from streamer.errors import ConfigError, HeaderError, ObjectStoreError, SourceError
    from streamer.plan.checkpoint import open_checkpoint

    try:
        opened = open_checkpoint(source)
    except (SourceError, HeaderError, ConfigError) as exc:  # missing, denied, empty, not safetensors
        raise SourceProblem(str(exc)) from None
    except (ObjectStoreError, ImportError) as exc:
        raise SourceUnreachable(f"{source}: {exc}") from None
    entries = [ref.entry for ref in opened.refs()]
    objects = {h.path: h.file_size for h in opened.headers} if remote else {}
    files = [] if remote else [Path(p).resolve() for p in opened.paths]
    return CheckpointFiles(
        source=source,
        files=files,
        tensor_bytes=sum(e.nbytes for e in entries),
        tensor_count=len(entries),
        objects=objects,
    )

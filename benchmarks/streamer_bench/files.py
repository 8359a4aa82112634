"""Which files a ``--source`` means, resolved by ``streamer``'s own source resolution.

Local and S3 sources alike go through ``streamer.plan.checkpoint.open_checkpoint`` (list the directory
or prefix or read the index, then read and validate every header), so the files, their sizes and
the tensor totals are the ones the loaders see, and a checkpoint streamer refuses is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class SourceProblem(Exception):
    """The source cannot be benchmarked (missing, empty, not safetensors)."""


class SourceUnreachable(Exception):
    """An S3 source could not be read for reasons other than the source itself (network, client)."""


@dataclass(frozen=True)
class CheckpointFiles:
    """What every loader is pointed at: the original source and its shard files."""

    source: str  # what streamer receives (a file, a directory, an index, or an s3:// URI of one)
    files: list[Path]  # local sources: what the peers receive, and what gets evicted / warmed
    tensor_bytes: int
    tensor_count: int
    objects: dict[str, int] = field(default_factory=dict)  # S3 sources: each shard's URI and size

    @property
    def remote(self) -> bool:
        return is_remote(self.source)

    @property
    def shards(self) -> dict[str, int]:
        """What the peers receive (paths or URIs), in order, with each one's size in bytes."""
        return dict(self.objects) if self.remote else {str(f): f.stat().st_size for f in self.files}


def is_remote(source: str) -> bool:
    return "://" in source


def resolve(source: str) -> CheckpointFiles:
    """A file, a directory (every ``*.safetensors``) or a ``*.index.json`` (the shards it names),
    local or on S3, resolved and its headers validated by ``streamer`` itself."""
    if is_remote(source) and not source.startswith("s3://"):
        raise SourceProblem(f"{source}: the only remote sources are s3://bucket/key URIs")
    # Imported here: the timed children import this module, and must not import streamer early.
    from streamer.config import S3Config
    from streamer.errors import ConfigError, HeaderError, S3Error, SourceError
    from streamer.plan.checkpoint import open_checkpoint

    try:
        opened = open_checkpoint(source, S3Config())
    except (SourceError, HeaderError, ConfigError) as exc:  # missing, denied, empty, not safetensors
        raise SourceProblem(str(exc)) from None
    except (S3Error, ImportError) as exc:
        raise SourceUnreachable(f"{source}: {exc}") from None
    entries = [ref.entry for ref in opened.refs()]
    remote = source.startswith("s3://")
    objects = {h.path: h.file_size for h in opened.headers} if remote else {}
    files = [] if remote else [Path(p).resolve() for p in opened.paths]
    return CheckpointFiles(
        source=source,
        files=files,
        tensor_bytes=sum(e.nbytes for e in entries),
        tensor_count=len(entries),
        objects=objects,
    )

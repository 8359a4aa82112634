"""Which files a ``--source`` means, resolved the way ``streamer.load`` resolves it.

S3 sources are resolved by streamer's own S3 code (list the prefix or read the index, then read
every header), so the objects, their sizes and the tensor totals are the ones the loaders see.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path


class SourceProblem(Exception):
    """The source cannot be benchmarked (missing, empty, not safetensors)."""


class SourceUnreachable(Exception):
    """An S3 source could not be read for reasons other than the source itself (network, client)."""


@dataclass(frozen=True)
class Checkpoint:
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


def _header_totals(path: Path) -> tuple[int, int]:
    """Tensor bytes and tensor count from a safetensors header (the loaders validate the rest)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise SourceProblem(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise SourceProblem(f"{path}: header length {length} is not plausible")
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise SourceProblem(f"{path}: header is not valid JSON ({exc})") from None
    spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
    return sum(end - start for start, end in spans), len(spans)


def resolve(source: str) -> Checkpoint:
    """A file, a directory (every ``*.safetensors``) or a ``*.index.json`` (the shards it names),
    local or on S3."""
    if is_remote(source):
        return _resolve_s3(source)
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise SourceProblem(f"{source}: no *.safetensors files in this directory")
    elif path.name.endswith(".json") and path.is_file():
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceProblem(f"{source}: not a safetensors index ({exc!r})") from None
        files = [path.parent / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SourceProblem(f"{source}: shards missing: {', '.join(missing)}")
    elif path.is_file():
        files = [path]
    else:
        raise SourceProblem(f"{source}: no such file or directory")
    totals = [_header_totals(f) for f in files]
    return Checkpoint(
        source=str(path),
        files=[f.resolve() for f in files],
        tensor_bytes=sum(t[0] for t in totals),
        tensor_count=sum(t[1] for t in totals),
    )


def _resolve_s3(source: str) -> Checkpoint:
    """An ``s3://`` object, prefix or index, resolved and its headers read by streamer itself,
    with the endpoint and credentials of the environment (``S3Config``'s defaults)."""
    if not source.startswith("s3://"):
        raise SourceProblem(f"{source}: the only remote sources are s3://bucket/key URIs")
    from streamer.config import S3Config
    from streamer.errors import ConfigError, HeaderError, S3Error, SourceError
    from streamer.sources.s3 import open_s3

    try:
        _, headers, objects, holder = open_s3([source], S3Config())
    except (SourceError, HeaderError, ConfigError) as exc:  # missing, denied, empty, not safetensors
        raise SourceProblem(str(exc)) from None
    except (S3Error, ImportError) as exc:
        raise SourceUnreachable(f"{source}: {exc}") from None
    holder.close()
    tensors = [t for h in headers for t in h.tensors]
    return Checkpoint(
        source=source,
        files=[],
        tensor_bytes=sum(t.nbytes for t in tensors),
        tensor_count=len(tensors),
        objects={str(o.uri): o.size for o in objects},
    )

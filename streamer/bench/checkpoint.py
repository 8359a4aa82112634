"""Which files a ``--source`` means, resolved the way ``streamer.load`` resolves it."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path


class SourceProblem(Exception):
    """The source cannot be benchmarked (missing, empty, not safetensors, remote)."""


@dataclass(frozen=True)
class Checkpoint:
    """What every loader is pointed at: the original source and its shard files."""

    source: str  # what streamer receives (a file, a directory or an index)
    files: list[Path]  # what the peers receive, and what gets evicted / warmed
    tensor_bytes: int
    tensor_count: int

    @property
    def file_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


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
    """A file, a directory (every ``*.safetensors``) or a ``*.index.json`` (the shards it names)."""
    if is_remote(source):
        raise SourceProblem(f"{source}: remote sources (s3://…) are not supported by streamer-bench yet")
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

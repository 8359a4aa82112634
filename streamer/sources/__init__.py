"""Where a checkpoint's files are: resolve what the user passed into a list of files."""

from streamer.sources.local import ResolvedSource, SourceLike, resolve

__all__ = ["ResolvedSource", "SourceLike", "resolve"]

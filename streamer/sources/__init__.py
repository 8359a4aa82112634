"""Where a checkpoint's files are: the rules every storage resolves a source by (lists, directories
or prefixes, ``*.index.json`` and its weight map); local paths are resolved in ``local.py``."""

from streamer.sources.local import (
    INDEX_SUFFIX,
    ResolvedSource,
    SourceLike,
    parse_index,
    resolve,
    source_texts,
    uri_scheme,
)

__all__ = [
    "INDEX_SUFFIX",
    "ResolvedSource",
    "SourceLike",
    "parse_index",
    "resolve",
    "source_texts",
    "uri_scheme",
]

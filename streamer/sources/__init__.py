"""Where a checkpoint's files are: the rules every storage resolves a source by (lists, directories
or prefixes, ``*.index.json`` and its weight map); local paths are resolved in ``local.py``."""

from streamer.sources.local import (
    INDEX_SUFFIX,
    MAX_INDEX_BYTES,
    SAFETENSORS_INDEX_SUFFIX,
    ResolvedSource,
    SourceArg,
    SourceLike,
    as_source,
    choose_index,
    parse_index,
    resolve,
    source_texts,
    uri_scheme,
)

__all__ = [
    "INDEX_SUFFIX",
    "MAX_INDEX_BYTES",
    "SAFETENSORS_INDEX_SUFFIX",
    "ResolvedSource",
    "SourceArg",
    "SourceLike",
    "as_source",
    "choose_index",
    "parse_index",
    "resolve",
    "source_texts",
    "uri_scheme",
]

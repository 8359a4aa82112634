"""The safetensors format: dtypes and strict header parsing. Pure; no I/O policy."""

from streamer.format.dtypes import DTYPES, DType, dtype_from_torch
from streamer.format.safetensors import (
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    FileHeader,
    TensorEntry,
    header_length,
    parse_header,
    read_header,
)

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "PREFIX_BYTES",
    "DType",
    "FileHeader",
    "TensorEntry",
    "dtype_from_torch",
    "header_length",
    "parse_header",
    "read_header",
]

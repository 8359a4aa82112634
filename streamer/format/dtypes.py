"""The safetensors dtype names streamer understands, and what they mean in torch.

The table mirrors ``safetensors.torch`` (0.8), plus ``F8_E8M0``, which torch can hold as
``float8_e8m0fnu``. Sub-byte dtypes (``F4``, ``F6_*``) have no torch element type, so a header
that uses them is rejected rather than loaded into a wrong-sized buffer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from streamer.errors import ConfigError


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: its name in headers, its torch dtype and its element size."""

    name: str
    torch_dtype: torch.dtype
    itemsize: int


def _table(*entries: tuple[str, torch.dtype]) -> Mapping[str, DType]:
    # The size comes from torch itself, so the table cannot disagree with the tensors we build.
    return MappingProxyType({name: DType(name, dt, dt.itemsize) for name, dt in entries})


DTYPES: Mapping[str, DType] = _table(
    ("F64", torch.float64),
    ("F32", torch.float32),
    ("F16", torch.float16),
    ("BF16", torch.bfloat16),
    ("I64", torch.int64),
    ("I32", torch.int32),
    ("I16", torch.int16),
    ("I8", torch.int8),
    ("U8", torch.uint8),
    ("BOOL", torch.bool),
    ("F8_E4M3", torch.float8_e4m3fn),
    ("F8_E4M3FNUZ", torch.float8_e4m3fnuz),
    ("F8_E5M2", torch.float8_e5m2),
    ("F8_E5M2FNUZ", torch.float8_e5m2fnuz),
    ("F8_E8M0", torch.float8_e8m0fnu),
    ("C64", torch.complex64),
    ("U64", torch.uint64),
    ("U32", torch.uint32),
    ("U16", torch.uint16),
)

_BY_TORCH: Mapping[torch.dtype, DType] = MappingProxyType({d.torch_dtype: d for d in DTYPES.values()})


def dtype_from_torch(dtype: torch.dtype) -> DType:
    """The safetensors dtype for a torch dtype; ``ConfigError`` if safetensors cannot store it."""
    try:
        return _BY_TORCH[dtype]
    except (KeyError, TypeError):  # TypeError: not even hashable, so certainly not a dtype
        supported = ", ".join(str(d.torch_dtype) for d in DTYPES.values())
        message = f"torch dtype {dtype} has no safetensors equivalent (supported: {supported})"
        raise ConfigError(message) from None

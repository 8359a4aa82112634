"""The safetensors dtype names streamer understands, and what they mean in torch.

The table is every dtype that ``safetensors.torch`` 0.8 loads into torch: its ``_TYPES`` plus
``F8_E8M0`` (``float8_e8m0fnu``) and ``F4`` (``float4_e2m1fn_x2``, two values per byte), which
its Rust side maps. ``F6_E2M3``/``F6_E3M2`` are safetensors dtypes with no torch type; a header
that uses them is rejected (``NO_TORCH_DTYPE``) rather than loaded into a wrong-sized buffer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from streamer.errors import ConfigError


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: its name in headers, its torch dtype and its element size.

    ``per_item`` header elements share one torch element: 2 for ``F4``, whose torch dtype packs
    two values into a byte, so a header shape ``[..., 2k]`` is the torch shape ``[..., k]``.
    """

    name: str
    torch_dtype: torch.dtype
    itemsize: int
    per_item: int = 1

    @property
    def bits(self) -> int:
        """Bits per header element, as safetensors counts them when it checks a tensor's size."""
        return 8 * self.itemsize // self.per_item


def _table(*entries: tuple[str, torch.dtype, int]) -> Mapping[str, DType]:
    # The size comes from torch itself, so the table cannot disagree with the tensors we build.
    return MappingProxyType({name: DType(name, dt, dt.itemsize, per_item) for name, dt, per_item in entries})


DTYPES: Mapping[str, DType] = _table(
    ("F64", torch.float64, 1),
    ("F32", torch.float32, 1),
    ("F16", torch.float16, 1),
    ("BF16", torch.bfloat16, 1),
    ("I64", torch.int64, 1),
    ("I32", torch.int32, 1),
    ("I16", torch.int16, 1),
    ("I8", torch.int8, 1),
    ("U8", torch.uint8, 1),
    ("BOOL", torch.bool, 1),
    ("F8_E4M3", torch.float8_e4m3fn, 1),
    ("F8_E4M3FNUZ", torch.float8_e4m3fnuz, 1),
    ("F8_E5M2", torch.float8_e5m2, 1),
    ("F8_E5M2FNUZ", torch.float8_e5m2fnuz, 1),
    ("F8_E8M0", torch.float8_e8m0fnu, 1),
    ("C64", torch.complex64, 1),
    ("U64", torch.uint64, 1),
    ("U32", torch.uint32, 1),
    ("U16", torch.uint16, 1),
    ("F4", torch.float4_e2m1fn_x2, 2),
)

# safetensors dtypes that torch cannot hold; safetensors itself refuses to load them into torch.
NO_TORCH_DTYPE = frozenset({"F6_E2M3", "F6_E3M2"})

_BY_TORCH: Mapping[torch.dtype, DType] = MappingProxyType({d.torch_dtype: d for d in DTYPES.values()})


def dtype_from_torch(dtype: torch.dtype) -> DType:
    """The safetensors dtype for a torch dtype; ``ConfigError`` if safetensors cannot store it."""
    try:
        return _BY_TORCH[dtype]
    except (KeyError, TypeError):  # TypeError: not even hashable, so certainly not a dtype
        supported = ", ".join(str(d.torch_dtype) for d in DTYPES.values())
        message = f"torch dtype {dtype} has no safetensors equivalent (supported: {supported})"
        raise ConfigError(message) from None

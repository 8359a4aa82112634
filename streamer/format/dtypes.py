"""The safetensors dtype names streamer understands, and what they mean in torch.

The table is every dtype that ``safetensors.torch`` 0.8 loads into torch: its ``_TYPES`` plus
``F8_E8M0`` (``float8_e8m0fnu``) and ``F4`` (``float4_e2m1fn_x2``, two values per byte), which
its Rust side maps. ``F6_E2M3``/``F6_E3M2`` are safetensors dtypes with no torch type; a header
that uses them is rejected (``NO_TORCH_DTYPE``) rather than loaded into a wrong-sized buffer.

The oldest torch streamer supports lacks some of these (``float8_e8m0fnu``, ``float4_e2m1fn_x2``,
...): the table holds what this torch has, and ``NO_TORCH_DTYPE`` says, for the rest, which torch
dtype is missing, so ``import streamer`` works and a header using one fails naming the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from streamer.errors import ConfigError


class DType(NamedTuple):
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


# safetensors name, torch attribute, header elements per torch element.
_NAMES: tuple[tuple[str, str, int], ...] = (
    ("F64", "float64", 1),
    ("F32", "float32", 1),
    ("F16", "float16", 1),
    ("BF16", "bfloat16", 1),
    ("I64", "int64", 1),
    ("I32", "int32", 1),
    ("I16", "int16", 1),
    ("I8", "int8", 1),
    ("U8", "uint8", 1),
    ("BOOL", "bool", 1),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
    ("C64", "complex64", 1),
    ("U64", "uint64", 1),
    ("U32", "uint32", 1),
    ("U16", "uint16", 1),
    ("F4", "float4_e2m1fn_x2", 2),
)


def _table() -> Mapping[str, DType]:
    # The size comes from torch itself, so the table cannot disagree with the tensors we build.
    found = ((name, getattr(torch, attr, None), per_item) for name, attr, per_item in _NAMES)
    return MappingProxyType(
        {name: DType(name, dt, dt.itemsize, n) for name, dt, n in found if isinstance(dt, torch.dtype)}
    )


DTYPES: Mapping[str, DType] = _table()

# safetensors dtypes this torch cannot hold -> why, in the words a header error gives.
NO_TORCH_DTYPE: Mapping[str, str] = MappingProxyType(
    {
        "F6_E2M3": "has no torch equivalent (safetensors cannot load it either)",
        "F6_E3M2": "has no torch equivalent (safetensors cannot load it either)",
        **{
            name: f"has no torch equivalent in torch {torch.__version__} "
            f"(torch.{attr} is newer: upgrade torch)"
            for name, attr, _ in _NAMES
            if name not in DTYPES
        },
    }
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

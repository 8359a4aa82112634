"""Where tensor bytes land: device parsing and the per-device destinations."""

from __future__ import annotations

import torch

from streamer.errors import DeviceError


def parse_device(device: str | int | torch.device) -> torch.device:
    """Validates the destination without initialising CUDA; an int ``n`` is ``cuda:n``, as
    ``safetensors`` and ``torch.Tensor.to`` read it."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"unknown device {device!r}: {exc}") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "cuda":
        # Neither call creates a CUDA context: they only count devices.
        if not torch.cuda.is_available():
            raise DeviceError(f"device {str(parsed)!r}: torch reports no usable CUDA device on this machine")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise DeviceError(f"device {str(parsed)!r}: this machine has {count} CUDA device(s)")
        return parsed
    raise DeviceError(f"device {str(parsed)!r}: only 'cpu' and 'cuda[:N]' are supported")

"""Where tensor bytes land: device parsing and the per-device destinations."""

from __future__ import annotations

import torch

from streamer.errors import DeviceError


def parse_device(device: str | torch.device) -> torch.device:
    """Validates the destination without initialising CUDA."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise DeviceError(f"unknown device {device!r}: {exc}") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "cuda":
        raise DeviceError(f"device {str(parsed)!r}: GPU destinations are not available in this version")
    raise DeviceError(f"device {str(parsed)!r}: only 'cpu' is supported")

"""vLLM-free checks around a load: which device streamer reads to, and whether every parameter was loaded."""

from __future__ import annotations

import torch
from torch import nn

_MAX_NAMES_SHOWN = 20


def target_device(model: nn.Module) -> str:
    """``cuda:N`` when the model's parameters live on a GPU (streamer's staged path), else ``cpu``."""
    for parameter in model.parameters():
        device = parameter.device
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return f"cuda:{index}"
        if device.type != "meta":
            return "cpu"
    return "cpu"


def check_all_loaded(model: nn.Module, loaded: set[str] | None, *, quantized: bool) -> None:
    """Every parameter must come from the checkpoint, as vLLM's default loader requires.

    Like vLLM, only for unquantized models whose ``load_weights`` reports what it loaded:
    quantization methods create parameters that checkpoints need not carry.
    """
    if loaded is None or quantized:
        return
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_SHOWN])
        more = f" and {len(missing) - _MAX_NAMES_SHOWN} more" if len(missing) > _MAX_NAMES_SHOWN else ""
        raise ValueError(
            f"load format 'streamer': {len(missing)} parameter(s) were not initialized from the "
            f"checkpoint: {shown}{more}"
        )

"""Where staged bytes are copied to: fresh device memory, or tensors the caller already has.

A destination is a sorted list of disjoint file spans ("targets"), each backed by one flat
uint8 tensor that mirrors the span's bytes; every tensor of a run lies inside one target.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

from streamer.destinations.buffers import tensor_view
from streamer.format.safetensors import TensorEntry
from streamer.plan.segments import Span

# Device buffers mirror file bytes from an 8-aligned offset, so a tensor keeps the alignment it has
# in the file (safetensors writers keep every dtype aligned to its size, at most 8).
_MIRROR_ALIGNMENT = 8


class Layout(NamedTuple):
    """What a staged run reads: each loaded tensor's name and file span (engine file numbering),
    sorted by file and offset, and the regions that group neighbouring spans into one read."""

    names: Sequence[str]
    spans: Sequence[Span]
    regions: Sequence[Span]


class Destination(Protocol):
    @property
    def spans(self) -> Sequence[Span]:
        """The targets, sorted by file and offset."""

    def buffer(self, target: int) -> torch.Tensor:
        """The flat uint8 tensor of ``spans[target]``, allocated on first use."""

    def tensor(self, target: int, entry: TensorEntry) -> torch.Tensor:
        """The finished tensor, once its bytes are copied and the consumer ordered after them."""

    def release(self, target: int) -> None:
        """The run needs the target no more (its tensors own its memory from now on)."""


DestinationFor = Callable[[Layout], Destination]
"""Builds a run's destination from its layout, e.g. ``functools.partial(NewMemory, device)``."""


class NewMemory:
    """One allocation per group of neighbouring tensors on ``device``; tensors are views into it.

    A buffer is dropped by the run once its last tensor is handed out, so a view is the only
    thing that keeps it alive and it is never reused under a view.
    """

    def __init__(self, device: torch.device, layout: Layout) -> None:
        self.device = device
        self.spans = [Span(r.file, r.begin - r.begin % _MIRROR_ALIGNMENT, r.end) for r in layout.regions]
        self._buffers: dict[int, torch.Tensor] = {}

    def buffer(self, target: int) -> torch.Tensor:
        buffer = self._buffers.get(target)
        if buffer is None:
            span = self.spans[target]
            buffer = torch.empty(span.end - span.begin, dtype=torch.uint8, device=self.device)
            self._buffers[target] = buffer
        return buffer

    def tensor(self, target: int, entry: TensorEntry) -> torch.Tensor:
        return tensor_view(self._buffers[target], entry.begin - self.spans[target].begin, entry)

    def release(self, target: int) -> None:
        self._buffers.pop(target, None)


class ExistingTensors:
    """The caller's tensors, one target each (``load_into``).

    Contiguous tensors are written in place through a byte view; any other layout gets a
    contiguous scratch tensor on the same device, copied in once the tensor is complete.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
        self.spans = list(layout.spans)
        self._tensors = [tensors[name].detach() for name in layout.names]
        self._scratch: dict[int, torch.Tensor] = {}

    def buffer(self, target: int) -> torch.Tensor:
        tensor = self._tensors[target]
        if tensor.is_contiguous():
            return tensor.reshape(-1).view(torch.uint8)
        scratch = self._scratch.get(target)
        if scratch is None:
            scratch = torch.empty(
                tensor.numel() * tensor.element_size(), dtype=torch.uint8, device=tensor.device
            )
            self._scratch[target] = scratch
        return scratch

    def tensor(self, target: int, entry: TensorEntry) -> torch.Tensor:
        tensor = self._tensors[target]
        scratch = self._scratch.pop(target, None)
        if scratch is not None:
            tensor.copy_(scratch.view(tensor.dtype).view(tensor.shape))
        return tensor

    def release(self, target: int) -> None:
        self._scratch.pop(target, None)

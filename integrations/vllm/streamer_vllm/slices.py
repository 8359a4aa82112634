"""Tensor parallelism without a group: which part of each checkpoint tensor this rank's model keeps.

A tensor-parallel rank that loads alone (``"distributed": false``, or no group to load with)
needs only its shard of each column- or row-parallel weight: vLLM's weight loaders narrow every
tensor they are given to this rank's part and copy that part into the parameter. Which part is
learnt from the model itself, not from rules about layer types: ``model.load_weights`` runs over
*probes*, data-less (``meta``) tensors of the checkpoint's names, shapes and dtypes, whose
only effect is to note which view of each probe is copied into a parameter; nothing is copied.
The load then reads only those views (``streamer.safe_open(...).get_slice``) and hands vLLM each
tensor at full shape with its view filled: the loader, doing what it did for the probe, copies
exactly the bytes that were read.

A probe that is used in any other way (converted, combined, asked for a value) or whose loading
fails makes its tensor read whole: slicing is an optimisation that never guesses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("vllm.plugins.streamer")

Index = tuple[slice, ...]
WHOLE_FRACTION = 0.9  # a view of more than this share of its tensor is read whole


@dataclass
class _Seen:
    """What the model did with one probe: the views of it copied into parameters."""

    views: list[tuple[tuple[int, ...], tuple[int, ...], int]]  # shape, stride, offset (elements)
    whole: bool = False  # used otherwise than copied from: read all of it


class _Probe(torch.Tensor):
    """A meta tensor standing for a checkpoint tensor; views of it remain probes of the same tensor."""

    _seen: _Seen

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Iterable[type], args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            source = args[-1] if func is torch.Tensor.__setitem__ else args[1]
            for probe in _probes(args[:1]):  # a probe written into: nothing to learn from it
                probe._seen.whole = True
            if isinstance(source, _Probe):
                source._seen.views.append(
                    (tuple(source.shape), source.stride(), int(source.storage_offset()))
                )
                return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        probes = _probes(args) + _probes(kwargs.values())
        if not probes:
            return result
        if isinstance(result, (tuple, list)):
            return type(result)(_derived(item, probes) for item in result)
        if not isinstance(result, torch.Tensor) and not _is_metadata(func):
            for probe in probes:
                probe._seen.whole = True
        return _derived(result, probes)


def _derived(result: Any, probes: list[_Probe]) -> Any:
    """``result`` of an operation on ``probes``: a view of one of them stays a probe of its tensor;
    any other tensor made from them is a probe of nothing (so copying it changes nothing) and
    makes them read whole."""
    if not isinstance(result, torch.Tensor):
        return result
    derived = result.as_subclass(_Probe)
    if len(probes) == 1 and result._base is not None:
        derived._seen = probes[0]._seen
        return derived
    for probe in probes:
        probe._seen.whole = True
    derived._seen = _Seen([], whole=True)
    return derived


def _is_metadata(func: Callable[..., Any]) -> bool:
    """A question about a tensor's shape or type, which reads none of its values."""
    name = getattr(func, "__name__", "")
    return name in {"size", "dim", "numel", "__len__", "stride", "storage_offset", "is_contiguous", "__get__"}


def _probes(values: Iterable[Any]) -> list[_Probe]:
    """The probes among ``values`` and in the lists and tuples among them (``torch.cat``'s)."""
    found: list[_Probe] = []
    for value in values:
        if isinstance(value, (tuple, list)):
            found += _probes(value)
        elif isinstance(value, _Probe):
            found.append(value)
    return found


def _probe(shape: tuple[int, ...], dtype: torch.dtype) -> _Probe:
    probe = torch.empty(shape, dtype=dtype, device="meta").as_subclass(_Probe)
    probe._seen = _Seen([])
    return probe


def probe_slices(
    model: nn.Module, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, Index]:
    """For each checkpoint tensor (name: shape, dtype) whose one copied view is a box of at most
    ``WHOLE_FRACTION`` of it, that box as an index. The probes go to ``load_weights`` together;
    if that fails (a loader needs a value, or rejects a meta tensor), each goes alone, so that
    only the tensors whose loading fails are read whole."""
    loader: Any = model
    probes = {name: _probe(shape, dtype) for name, (shape, dtype) in tensors.items()}
    try:
        loader.load_weights(iter(probes.items()))
    except Exception as error:
        logger.debug("probing tensor by tensor: loading every probe at once failed: %r", error)
        probes = {}
        for name, (shape, dtype) in tensors.items():
            probe = _probe(shape, dtype)
            try:
                loader.load_weights(iter([(name, probe)]))
            except Exception as error:
                logger.debug("%s is read whole: its loader failed on a probe: %r", name, error)
                continue
            probes[name] = probe
    slices: dict[str, Index] = {}
    for name, probe in probes.items():
        shape = tensors[name][0]
        seen = probe._seen
        if seen.whole or len(seen.views) != 1:
            continue
        index = _box(shape, *seen.views[0])
        if index is not None and math.prod(s.stop - s.start for s in index) <= WHOLE_FRACTION * math.prod(
            shape
        ):
            slices[name] = index
    return slices


def _box(
    shape: tuple[int, ...], view_shape: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> Index | None:
    """The view as ``[a:b, c:d, ...]`` of a contiguous tensor of ``shape``, when it is one (the same
    strides, a start per dimension); else ``None``."""
    contiguous = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    if len(view_shape) != len(shape) or tuple(stride) != contiguous or 0 in view_shape:
        return None
    index = []
    for size, full, step in zip(view_shape, shape, contiguous, strict=True):
        start, offset = divmod(offset, step)
        if start + size > full:
            return None
        index.append(slice(start, start + size))
    return tuple(index) if offset == 0 else None

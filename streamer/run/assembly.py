"""Run assembly: which sink a read goes through, and the checks before bytes land in a caller's tensors.

The facade (``streamer.api``, ``streamer.handle``) says what to read and where; this module picks
how: small runs of local files on the caller's thread (``inline``), CPU runs into buffers under
the budget (``CpuSink``), device runs and ``load_into`` through the pinned ring (``StagedSink``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from streamer.backends.base import Storage
from streamer.config import UNLIMITED, StreamerConfig
from streamer.destinations import copy_engine, parse_device
from streamer.destinations.buffers import MemoryBudget, allocate_buffer, empty_tensor, tensor_view
from streamer.destinations.ring import RingCache
from streamer.destinations.targets import ExistingTensors, NewMemory
from streamer.engine import native
from streamer.errors import ConfigError
from streamer.plan.checkpoint import Checkpoint, TensorRef
from streamer.run.cpu import CpuSink
from streamer.run.driver import Run
from streamer.run.inline import InlineRun, fits_inline

if TYPE_CHECKING:
    from streamer.run.staged import Staging


def new_run(
    checkpoint: Checkpoint,
    storage: Storage,
    refs: Sequence[TensorRef],
    config: StreamerConfig,
    device: torch.device,
    rings: RingCache,
    *,
    ordered: bool,
    keep_all: bool = False,
) -> Run | InlineRun:
    """A read of ``refs`` into new tensors on ``device``: a direct read into CPU memory (small runs
    of local files on the caller's thread), or a staged one through the ring where a copy engine
    is needed.

    ``keep_all``: the caller keeps every tensor (``load``), so host buffers are not limited. The
    staged ring stays bounded by ``memory_limit`` even then: the tensors live on the device, the
    limit bounds host memory.
    """
    engine = copy_engine.staged_engine(device)
    if engine is None:
        if _inline_reads(storage, config) and fits_inline(refs, config, keep_all=keep_all):
            return InlineRun(checkpoint, refs, config, keep_all=keep_all)
        config = dataclasses.replace(config, memory_limit=UNLIMITED) if keep_all else config
        cpu = functools.partial(
            CpuSink,
            config,
            delivery=storage.delivery,
            request_bytes=storage.read_cost.request_bytes,
        )
        return Run(checkpoint, refs, config, cpu, ordered=ordered, storage=storage)
    from streamer.run.staged import Staging  # the ring's machinery: device loads and load_into only

    staging = Staging(device, engine, functools.partial(NewMemory, device), rings)
    return _staged_run(checkpoint, refs, config, staging, storage, ordered=ordered)


def _inline_reads(storage: Storage, config: StreamerConfig) -> bool:
    """Whether small runs may be read on the caller's thread: local files the engine would read
    by path, unless ``io_mode="direct"`` asks for O_DIRECT."""
    return storage.delivery.engine_reads and config.io_mode != "direct"


def fill(
    storage: Storage,
    checkpoint: Checkpoint,
    dest: Mapping[str, torch.Tensor],
    config: StreamerConfig,
) -> list[dict[str, Any]]:
    """Reads the checkpoint's tensors named in ``dest`` into them, in place, one device at a time
    (each after ``check_destination``); zero-size ones have nothing to read. Each run's metrics."""
    by_device: dict[torch.device, list[str]] = {}
    for name, tensor in dest.items():
        check_destination(checkpoint, name, tensor)
        by_device.setdefault(tensor.device, []).append(name)
    from streamer.run.staged import Staging

    rings = RingCache()
    measured: list[dict[str, Any]] = []
    for where, names in by_device.items():
        device = parse_device(where)
        refs = [checkpoint.tensors[name] for name in names if checkpoint.tensors[name].entry.nbytes > 0]
        engine = copy_engine.staged_engine(device) or copy_engine.ThreadCopyEngine()
        tensors = {name: dest[name] for name in names}
        staging = Staging(device, engine, functools.partial(ExistingTensors, tensors), rings)
        run = _staged_run(checkpoint, refs, config, staging, storage, ordered=False)
        for _ in run.results():
            pass
        measured.append(run.metrics.as_dict())
    return measured


def check_destination(checkpoint: Checkpoint, name: str, tensor: object) -> None:
    """A caller's tensor for ``name`` must have the checkpoint's dtype and shape."""
    ref = checkpoint.tensors[name]
    path = checkpoint.headers[ref.file].path
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"dest holds a {type(tensor).__name__}, not a tensor", path=path, tensor=name)
    entry = ref.entry
    if tensor.dtype != entry.dtype.torch_dtype:
        raise ConfigError(
            f"dtype mismatch: checkpoint {entry.dtype.name} ({entry.dtype.torch_dtype}), dest {tensor.dtype}",
            path=path,
            tensor=name,
        )
    if tuple(tensor.shape) != entry.shape:
        raise ConfigError(
            f"shape mismatch: checkpoint {list(entry.shape)}, dest {list(tensor.shape)}",
            path=path,
            tensor=name,
        )


def new_tensor(
    refs: Sequence[TensorRef], device: torch.device, hugepages: bool, position: int
) -> torch.Tensor:
    """Fresh memory for a tensor a group read assembles: huge pages for large ones on the CPU
    where on, since first touch of fresh memory costs more than the copy into it."""
    entry = refs[position].entry
    if entry.nbytes == 0:
        return empty_tensor(entry, device)
    if device.type != "cpu" or not hugepages or entry.nbytes < native.HUGEPAGE_MIN_BYTES:
        return torch.empty(entry.shape, dtype=entry.dtype.torch_dtype, device=device)
    buffer, _ = allocate_buffer(entry.nbytes, hugepages=True, budget=MemoryBudget(None))
    return tensor_view(buffer, 0, entry)


def _staged_run(
    checkpoint: Checkpoint,
    refs: Sequence[TensorRef],
    config: StreamerConfig,
    staging: Staging,
    storage: Storage,
    *,
    ordered: bool,
) -> Run:
    """A run through the ring: the staged reader count, requests and the default ring sized by
    ``storage``'s reads."""
    from streamer.run.staged import StagedSink

    config = config.for_staged()
    sink = functools.partial(
        StagedSink,
        staging,
        config,
        request_bytes=storage.read_cost.request_bytes,
        reads_in_flight=storage.reads_in_flight(config),
    )
    return Run(checkpoint, refs, config, sink, ordered=ordered, storage=storage)

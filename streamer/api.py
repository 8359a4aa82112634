"""The public entry points: ``load``, ``load_file`` and the ``open`` handle."""

from __future__ import annotations

import dataclasses
import inspect
import os
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Literal

import torch

from streamer.checkpoint import open_checkpoint
from streamer.config import StreamerConfig
from streamer.destinations import parse_device
from streamer.errors import ConfigError, StreamerError
from streamer.pipeline import LoadRun
from streamer.sources import SourceLike

Order = Literal["completion", "checkpoint"]


class _Iteration:
    """One pass over a run; ``close()`` ends it for good and frees what its generator holds."""

    def __init__(self, run: LoadRun) -> None:
        self._results = run.results()
        self._stopped = False

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._stopped:
            raise StreamerError("this iteration was stopped: the handle was closed or iterated again")
        return next(self._results)

    def close(self) -> None:
        # A pass that already ran to its end just stays finished.
        self._stopped = inspect.getgeneratorstate(self._results) != inspect.GEN_CLOSED
        self._results.close()


class Streamer:
    """A checkpoint opened for reading, ``safe_open``-style.

    Headers are parsed when it is opened (so bad files fail here); tensor bytes are
    read when it is iterated or asked for a tensor. Iterating yields ``(name, tensor)``
    as tensors complete (``order="checkpoint"``: in file and offset order). Every
    tensor handed out is backed by memory no other tensor will ever reuse.
    """

    def __init__(
        self,
        source: SourceLike,
        *,
        device: str | torch.device = "cpu",
        config: StreamerConfig | None = None,
        order: Order = "completion",
    ) -> None:
        if order not in ("completion", "checkpoint"):
            raise ConfigError(f"order must be 'completion' or 'checkpoint', got {order!r}")
        self.device = parse_device(device)
        self.config = config if config is not None else StreamerConfig()
        self._order = order
        self._checkpoint = open_checkpoint(source)
        self._run: LoadRun | None = None  # the last read, for metrics
        self._iteration: weakref.ref[_Iteration] | None = None

    def keys(self) -> list[str]:
        return list(self._checkpoint.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._checkpoint.tensors

    def __len__(self) -> int:
        return len(self._checkpoint.tensors)

    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of the files, merged (the first file wins a clash)."""
        return self._checkpoint.metadata()

    @property
    def files(self) -> tuple[str, ...]:
        return self._checkpoint.paths

    @property
    def metrics(self) -> dict[str, Any]:
        """Measurements of the last completed (or closed) read; empty before any."""
        return self._run.metrics.as_dict() if self._run is not None else {}

    def get_tensor(self, name: str) -> torch.Tensor:
        """Reads one tensor (all workers share it when it is large); an iteration may be under way."""
        run = LoadRun(self._checkpoint, [self._checkpoint.ref(name)], self.config, ordered=True)
        self._run = run
        results = run.results()
        try:
            return next(results)[1]
        finally:
            results.close()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Starts a new pass (ending any pass still under way); dropping the iterator ends it too."""
        self.close()
        run = LoadRun(
            self._checkpoint, list(self._checkpoint.refs()), self.config, ordered=self._order == "checkpoint"
        )
        iteration = _Iteration(run)
        self._run = run
        self._iteration = weakref.ref(iteration)
        return iteration

    def close(self) -> None:
        """Stops a pass in progress and releases its threads, files and buffers."""
        iteration = self._iteration() if self._iteration is not None else None
        if iteration is not None:
            iteration.close()

    def __enter__(self) -> Streamer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def open(
    source: SourceLike,
    *,
    device: str | torch.device = "cpu",
    config: StreamerConfig | None = None,
    order: Order = "completion",
) -> Streamer:
    """Opens a checkpoint: a file, a list of files, a directory or a ``*.index.json``."""
    return Streamer(source, device=device, config=config, order=order)


def load(
    source: SourceLike, device: str | torch.device = "cpu", *, config: StreamerConfig | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, keyed in checkpoint order.

    The result holds everything, so ``memory_limit`` does not apply here; use ``open``
    to stream under a limit.
    """
    config = dataclasses.replace(config if config is not None else StreamerConfig(), memory_limit=None)
    with Streamer(source, device=device, config=config) as handle:
        loaded = dict(iter(handle))
        names = handle.keys()
    return {name: loaded[name] for name in names}


def load_file(
    filename: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    *,
    config: StreamerConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Drop-in for ``safetensors.torch.load_file``."""
    return load(filename, device, config=config)

"""The public entry points: ``load``, ``load_file``, ``load_into`` and ``open`` (the handle is
``streamer.handle.Streamer``). Each composes a storage session, a parsed checkpoint and a run
(``streamer.run.assembly``, ``streamer.group`` for group loads)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch

from streamer.backends import open_storage
from streamer.backends.base import Storage
from streamer.backends.sources import SourceArg, as_source
from streamer.config import StreamerConfig, default_config
from streamer.errors import ConfigError, KeyMismatchError, StreamerError
from streamer.handle import Order, Streamer
from streamer.observe.events import LoadRecord, report
from streamer.plan.checkpoint import Checkpoint, KeySelection, confirmed, read_checkpoint
from streamer.run.assembly import fill

if TYPE_CHECKING:  # a group load imports it (torch.distributed alone costs ~40 ms)
    import torch.distributed as dist

__all__ = [
    "IncompatibleKeys",
    "Streamer",
    "check_backend",
    "load",
    "load_file",
    "load_into",
    "open",
    "source_files",
]


def open(
    source: SourceArg,
    device: str | int | torch.device = "cpu",
    *,
    config: StreamerConfig | None = None,
    order: Order = "completion",
    group: dist.ProcessGroup | None = None,
    keys: KeySelection | None = None,
) -> Streamer:
    """Opens a checkpoint: a file, a list of files, a directory or a ``*.index.json``.

    ``group``: iterating loads with the ranks of this process group (see ``streamer.group``).
    ``keys``: only these tensors (names, or a test on a name), as if the checkpoint held no other.
    """
    return Streamer(source, device=device, config=config, order=order, group=group, keys=keys)


def source_files(source: SourceArg, *, config: StreamerConfig | None = None) -> list[str]:
    """The files ``source`` resolves to (a directory's or prefix's listing, an index's shards), in
    checkpoint order, their headers not read as one checkpoint: files that are not one (each
    tensor-parallel rank's own, holding the same names) are listed as well."""
    settings = config if config is not None else default_config()
    text = as_source(source)
    with open_storage(text, settings) as storage:
        return list(storage.open(text).source.paths)


def load(
    source: SourceArg,
    device: str | int | torch.device = "cpu",
    *,
    config: StreamerConfig | None = None,
    progress: bool = False,
    group: dist.ProcessGroup | None = None,
    keys: KeySelection | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (or those ``keys`` selects), keyed in checkpoint order.

    The result holds everything, so for CPU ``memory_limit`` does not apply here (use
    ``open`` to stream under a limit); for a GPU it bounds the host staging ring.
    ``progress`` shows a bytes and GB/s bar on stderr (tqdm's when it is installed).
    ``group``: every rank of this ``torch.distributed`` group calls ``load`` for the same
    checkpoint; each reads about ``1/N`` of the bytes and receives the rest (``streamer.group``).
    """
    with Streamer(source, device=device, config=config, group=group, keys=keys) as handle:
        return handle.load_all(progress=progress)


SAFETENSORS_BACKENDS = ("mmap", "pread")  # what safetensors' ``backend=`` accepts; streamer reads its own way


def load_file(
    filename: SourceArg,
    device: str | int | torch.device = "cpu",
    *,
    backend: str = "mmap",
    config: StreamerConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Drop-in for ``safetensors.torch.load_file``; ``backend`` is checked as safetensors checks it,
    then ignored (streamer reads with its own engine)."""
    check_backend(backend)
    return load(filename, device, config=config)


def check_backend(backend: str) -> None:
    if backend not in SAFETENSORS_BACKENDS:
        expected = ", ".join(repr(b) for b in SAFETENSORS_BACKENDS)
        raise ConfigError(f"backend {backend!r} is invalid (expected one of: {expected})")


class IncompatibleKeys(NamedTuple):
    """What ``load_into(strict=False)`` left alone, as ``torch.nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]  # in ``dest``, not in the checkpoint: left unchanged
    unexpected_keys: list[str]  # in the checkpoint, not in ``dest``: not read


def load_into(
    dest: Mapping[str, torch.Tensor] | torch.nn.Module,
    source: SourceArg,
    *,
    config: StreamerConfig | None = None,
    strict: bool = True,
    group: dist.ProcessGroup | None = None,
) -> IncompatibleKeys:
    """Reads the checkpoint straight into existing tensors (CPU or GPU): a state dict, or a module
    (its parameters and buffers, filled in place).

    Each tensor must have the checkpoint's dtype and shape (``ConfigError`` naming it otherwise).
    With ``strict`` (the default) the names must match exactly: a ``KeyMismatchError`` (a
    ``SourceError``) lists what each side lacks, both ways at once (``missing_keys``,
    ``unexpected_keys``); without it, the names both sides have are loaded and the rest is
    returned as ``IncompatibleKeys(missing_keys, unexpected_keys)``.
    Bytes go through a host ring of at most ``memory_limit`` bytes and are copied into the
    tensors in place; when this returns, the current stream of each GPU is ordered after the
    copies, and an error can leave some tensors loaded and others not.

    ``group``: every rank of this ``torch.distributed`` group calls ``load_into`` for the same
    checkpoint and the same tensor names; each reads about ``1/N`` of the bytes and receives the
    rest (``streamer.group``). The tensors of ``dest`` must then be contiguous.
    """
    config = config if config is not None else default_config()
    source = as_source(source)
    tensors = _destination(dest)
    first = next(iter(tensors.values()), None)
    record = LoadRecord(source, first.device.type if first is not None else "cpu")
    try:
        return _open_and_load_into(tensors, source, config, strict, group, record)
    except Exception as error:
        record.fail(error)
        raise
    finally:
        report(record, config)


def _open_and_load_into(
    tensors: Mapping[str, torch.Tensor],
    source: str | list[str],
    config: StreamerConfig,
    strict: bool,
    group: dist.ProcessGroup | None,
    record: LoadRecord,
) -> IncompatibleKeys:
    with open_storage(source, config) as storage:
        checkpoint = read_checkpoint(storage, source)
        if group is not None:  # every rank plans from a confirmed open
            checkpoint = confirmed(storage, checkpoint)
        # From a provisional open the load reads at once; nothing reaches ``dest`` before the
        # storage confirms it, and if the source changed the load runs again from the fresh one.
        try:
            incompatible = _load_into(tensors, storage, checkpoint, config, strict, group, record)
        except StreamerError:
            fresh = confirmed(storage, checkpoint)
            if fresh is checkpoint:
                raise
        else:
            fresh = confirmed(storage, checkpoint)
            if fresh is checkpoint:
                return incompatible
        return _load_into(tensors, storage, fresh, config, strict, group, record)


def _destination(dest: object) -> Mapping[str, torch.Tensor]:
    """``load_into``'s ``dest``: a mapping of names to tensors, or a module (its ``state_dict``,
    whose tensors share their parameters' and buffers' memory, so they are filled in place)."""
    if isinstance(dest, torch.nn.Module):
        return dest.state_dict()
    if not isinstance(dest, Mapping):
        raise ConfigError(
            f"dest must be a mapping of names to tensors (a state_dict) or a torch.nn.Module, got "
            f"{type(dest).__name__}"
        )
    return dest


def _load_into(
    dest: Mapping[str, torch.Tensor],
    storage: Storage,
    checkpoint: Checkpoint,
    config: StreamerConfig,
    strict: bool,
    group: dist.ProcessGroup | None,
    record: LoadRecord,
) -> IncompatibleKeys:
    missing = [name for name in dest if name not in checkpoint.tensors]
    unexpected = [name for name in checkpoint.tensors if name not in dest]
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected, paths=checkpoint.paths)
    if group is not None:
        from streamer.group.exchange import exchange_into

        record.add(exchange_into(dest, storage, checkpoint, config, group))
    else:
        wanted = {name: dest[name] for name in dest if name in checkpoint.tensors}
        for measured in fill(storage, checkpoint, wanted, config):
            record.add(measured)
    return IncompatibleKeys(missing, unexpected)

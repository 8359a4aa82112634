"""The public entry points: ``load``, ``load_file``, ``load_into`` and the ``open`` handle."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Generator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from streamer.backends import open_storage
from streamer.backends.base import ReadCost, StaleOpen, Storage
from streamer.checkpoint import Checkpoint, TensorRef, confirmed, read_checkpoint
from streamer.config import UNLIMITED, StreamerConfig
from streamer.destinations import copy_engine, parse_device
from streamer.destinations.cpu import MemoryBudget, allocate_buffer, empty_tensor, tensor_view
from streamer.destinations.ring import RingCache
from streamer.destinations.targets import ExistingTensors, NewMemory
from streamer.engine import native
from streamer.errors import ConfigError, FileClosedError, KeyMismatchError, StreamerError
from streamer.format.safetensors import TensorEntry
from streamer.memory import HeldTensors, over_limit_message, streaming_budget, warn_from_caller
from streamer.progress import ByteProgress
from streamer.readahead import MAX_WINDOW_BYTES, KeyWalk
from streamer.run.cpu import CpuSink
from streamer.run.driver import Run
from streamer.run.inline import InlineRun, fits_inline
from streamer.run.packed import PackedSink
from streamer.run.staged import StagedSink, Staging
from streamer.slicing import Packing
from streamer.sources import SourceArg, as_source

if TYPE_CHECKING:  # a group load imports them (torch.distributed alone costs ~40 ms)
    import torch.distributed as dist

    from streamer.group.exchange import GroupExchange

Order = Literal["completion", "checkpoint"]


class _Iteration:
    """One pass over a run; ``close()`` ends it for good and frees what its generator holds.

    Threads calling ``next`` take turns (each tensor goes to one of them); ``close`` from another
    thread waits for the turn in progress, so a generator is never entered twice at once.
    """

    def __init__(self, results: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        self._results = results
        self._stopped = False
        self._turn = threading.Lock()
        self.owner = threading.current_thread()

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        with self._turn:
            if self._stopped:
                raise StreamerError("this iteration was stopped: the handle was closed or iterated again")
            return next(self._results)

    @property
    def running(self) -> bool:
        """Started or not, but neither finished nor closed."""
        return not self._stopped and inspect.getgeneratorstate(self._results) != inspect.GEN_CLOSED

    def close(self) -> None:
        with self._turn:
            # A pass that already ran to its end just stays finished.
            self._stopped = inspect.getgeneratorstate(self._results) != inspect.GEN_CLOSED
            self._results.close()


class Streamer:
    """A checkpoint opened for reading, ``safe_open``-style.

    Headers are parsed when it is opened (so bad files fail here); tensor bytes are
    read when it is iterated or asked for a tensor. Iterating yields ``(name, tensor)``
    as tensors complete (``order="checkpoint"``: in file and offset order). Every
    tensor handed out is backed by memory no other tensor will ever reuse.

    On a GPU, reads go through a ring of pinned host slots (``memory_limit`` bytes; by default
    two rounds of the storage's reads in flight, at most 1 GiB: 128 MiB for local files, 1 GiB
    from S3; never more than the bytes to read), allocated once and reused by every read of
    this handle until ``close()``; tensors are views into one device allocation per group of
    neighbouring tensors, handed out once the current stream is ordered after their copies.

    With ``group`` (a ``torch.distributed`` process group), iterating reads only this rank's
    share of the checkpoint and receives the rest from the other ranks (``streamer.group``: every
    rank must iterate too); ``get_tensor`` and ``read`` still read alone.
    """

    def __init__(
        self,
        source: SourceArg,
        device: str | int | torch.device = "cpu",
        *,
        config: StreamerConfig | None = None,
        order: Order = "completion",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if order not in ("completion", "checkpoint"):
            raise ConfigError(f"order must be 'completion' or 'checkpoint', got {order!r}")
        self.device = parse_device(device)
        self.config = config if config is not None else StreamerConfig()
        self._order = order
        source = as_source(source)
        # The storage session (for S3 a client: a thread, a loop, sockets) serves every run of
        # this handle; closed by close(), or when the handle is collected without it.
        self._storage = open_storage(source, self.config)
        weakref.finalize(self, self._storage.close)
        try:
            # Maybe provisional (a cache's note of the source): a full pass reads from it at once,
            # everything else waits for the storage to confirm it (``checkpoint``).
            self._checkpoint = read_checkpoint(self._storage, source)
        except BaseException:
            self._storage.close()
            raise
        self._provisional = True
        self._group = group
        self._run: Run | InlineRun | None = None  # the last read, for metrics
        self._exchange: GroupExchange | None = None  # the last read's, if it was a group read
        self._iteration: weakref.ref[_Iteration] | None = None
        self._rings = RingCache()
        self._walk: KeyWalk | None = None  # get_tensor's read-ahead
        self._held = HeldTensors()  # what get_tensor gave out, against an explicit memory_limit
        self._warned_held = False
        self._closed = False

    def __repr__(self) -> str:
        checkpoint = self._checkpoint
        paths = checkpoint.paths
        where = repr(paths[0]) if len(paths) == 1 else f"{paths[0]!r} and {len(paths) - 1} more file(s)"
        state = "closed" if self._closed else "open"
        return (
            f"<streamer.Streamer {where}: {len(checkpoint.tensors)} tensors, {checkpoint.nbytes:,} bytes, "
            f"device={self.device}, {state}>"
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @contextlib.contextmanager
    def reopened(self) -> Iterator[None]:
        """Reads allowed again for a moment, then released (if the handle was closed): how a
        ``safe_open`` slice taken before ``close()`` still reads, as safetensors' slices do."""
        closed, self._closed = self._closed, False
        try:
            yield
        finally:
            if closed:
                self.close()

    def _check_open(self) -> None:
        """Reading from a closed handle is a ``FileClosedError``, as from a closed ``safe_open``."""
        if self._closed:
            raise FileClosedError("the handle is closed", path=", ".join(self._checkpoint.paths))

    def keys(self) -> list[str]:
        return list(self.checkpoint.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.checkpoint.tensors

    def __len__(self) -> int:
        return len(self.checkpoint.tensors)

    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of the files, merged (the first file wins a clash)."""
        return self.checkpoint.metadata()

    @property
    def files(self) -> tuple[str, ...]:
        return self.checkpoint.paths

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint: what a full read loads (for progress bars)."""
        return self.checkpoint.nbytes

    @property
    def metrics(self) -> dict[str, Any]:
        """Measurements of the last completed (or closed) read; empty before any."""
        run = self._exchange.run if self._exchange is not None else self._run
        if run is None:
            return {}
        measured = run.metrics.as_dict()
        if self._exchange is not None:
            measured["group"] = self._exchange.stats()
        return measured

    @property
    def checkpoint(self) -> Checkpoint:
        """The parsed headers and the name -> ``TensorRef`` table (what ``read`` takes)."""
        self._confirm()
        return self._checkpoint

    def _confirm(self) -> bool:
        """Waits for the storage to confirm the open the checkpoint came from; True when it did
        not and the checkpoint was replaced by the fresh one."""
        if not self._provisional:
            return False
        checkpoint = confirmed(self._storage, self._checkpoint)
        self._provisional = False
        replaced, self._checkpoint = checkpoint is not self._checkpoint, checkpoint
        return replaced

    @property
    def read_cost(self) -> ReadCost:
        """What one more read request costs this handle's storage."""
        return self._storage.read_cost

    def read_cost_of(self, ref: TensorRef) -> ReadCost:
        """What one more read request costs reading ``ref`` now (how ``get_slice`` plans): local
        bytes in the page cache cost less per request than bytes on the device."""
        return self._storage.read_cost_of(self.checkpoint.files[ref.file], (ref.entry.begin, ref.entry.end))

    def read(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """The tensors of ``refs``, in the order given, from one run that keeps them all.

        A ref may be a byte range of one of this checkpoint's tensors under a name of its own
        (``rows``).
        """
        self._check_open()
        run = self._new_run(refs, ordered=False, keep_all=True)
        self._run, self._exchange = run, None
        got = dict(run.results())
        return [got[ref.entry.name] for ref in refs]

    def read_packed(self, ref: TensorRef, packing: Packing) -> torch.Tensor:
        """The ranges of ``ref``'s tensor that ``packing`` lays out, back to back in one CPU buffer
        (uint8), read by one run of the handle's storage: how ``get_slice`` reads a shard."""
        self._check_open()
        sink = functools.partial(PackedSink, packing, hugepages=self.config.hugepages)
        run = Run(self.checkpoint, [ref], self.config, sink, ordered=False, storage=self._storage)
        self._run, self._exchange = run, None
        ((_, buffer),) = run.results()
        return buffer

    def group_read(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """``read`` with the handle's group: every rank calls it, each with the refs it wants
        (ranks may want different tensors or slices, e.g. ``rows``); bytes several ranks want are
        read once, bytes no rank wants are not read."""
        self._check_open()
        if self._group is None:
            raise ConfigError("group_read needs a handle opened with group=")
        self._stop()
        exchange = self._new_exchange(refs, self._group, ordered=False, keep_all=True)
        got = dict(exchange.results())
        return [got[ref.entry.name] for ref in refs]

    def _new_exchange(
        self, refs: Sequence[TensorRef], group: dist.ProcessGroup, *, ordered: bool, keep_all: bool
    ) -> GroupExchange:
        """A group run of ``refs`` into new tensors; the handle's current read from now on."""
        from streamer.group.exchange import GroupExchange

        exchange = GroupExchange(
            self.checkpoint,
            self._storage,
            refs,
            group,
            self.config,
            functools.partial(_new_tensor, refs, self.device, self.config.hugepages),
            ordered=ordered,
            new_tensors=self.device.type == "cpu",
            keep_all=keep_all,
        )
        self._run, self._exchange = None, exchange
        return exchange

    def rows(self, name: str, start: int, stop: int) -> TensorRef:
        """Rows ``start:stop`` (along the first dimension) of a tensor, as a ref of their own for
        ``read`` or ``group_read``: a tensor-parallel rank's shard of a row-split weight."""
        ref = self.checkpoint.ref(name)
        entry = ref.entry
        if not entry.shape or not 0 <= start <= stop <= entry.shape[0]:
            raise ConfigError(f"rows {start}:{stop} are not rows of shape {list(entry.shape)}", tensor=name)
        row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        shape = (stop - start, *entry.shape[1:])
        begin = entry.begin + start * row
        sliced = TensorEntry(
            f"{name}[{start}:{stop}]", entry.dtype, shape, begin, begin + (stop - start) * row
        )
        return TensorRef(ref.file, sliced)

    def get_tensor(self, name: str) -> torch.Tensor:
        """Reads one tensor (all workers share it when it is large); an iteration may be under way.

        Called for the keys in ``keys()`` order, it reads the ones that follow ahead, in windows
        (``streamer.readahead``).
        """
        self._check_open()
        ref = self.checkpoint.ref(name)  # a missing name raises here, naming it
        if self._walk is None:
            self._walk = self.key_walk(self.keys())
        tensor = self._walk.get(ref.entry.name)
        limit = self.config.explicit_memory_limit  # host memory: on a GPU it bounds the ring only
        if limit is not None and self.device.type == "cpu" and not self._warned_held:
            self._held.hold(tensor)
            if self._held.bytes > limit:  # the rule a streaming pass keeps
                self._warned_held = True
                warn_from_caller(over_limit_message(limit, self._held.bytes))
        return tensor

    def key_walk(self, order: Sequence[str]) -> KeyWalk:
        """A read-ahead for ``get_tensor``-style calls walking the keys in ``order``."""
        tensors = self.checkpoint.tensors
        # Within what a streaming read of this checkpoint may hold: the user's limit, or the auto one
        # (under 256 MiB only where the host has little memory left).
        limit = streaming_budget(self.config, [ref.entry.nbytes for ref in tensors.values()]).limit
        return KeyWalk(
            order,
            lambda name: self._read_alone(tensors[name]),
            lambda names: self.read([tensors[name] for name in names]),
            lambda name: tensors[name].entry.nbytes,
            max_window_bytes=MAX_WINDOW_BYTES if limit is None else min(limit, MAX_WINDOW_BYTES),
        )

    def _read_alone(self, ref: TensorRef) -> torch.Tensor:
        """One tensor, under ``memory_limit`` (which warns when the tensor alone exceeds it)."""
        run = self._new_run([ref], ordered=True)
        self._run, self._exchange = run, None
        results = run.results()
        try:
            return next(results)[1]
        finally:
            results.close()

    def __getitem__(self, name: str) -> torch.Tensor:
        """``handle[name]``, so ``dict(handle)`` works: ``get_tensor``, reading ahead along ``keys()``."""
        return self.get_tensor(name)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Starts a new pass; dropping the iterator ends it.

        Iterating again from the thread that started the pass under way ends that pass. From
        another thread, while that pass runs, it is a ``StreamerError`` and the first pass goes
        on (open a second handle to read in parallel). Threads may share one iterator: ``next``
        calls take turns and each tensor goes to one of them.
        """
        return self._iterate(keep_all=False)

    def _iterate(self, *, keep_all: bool) -> _Iteration:
        """``keep_all``: the caller keeps every tensor (``load``), so host buffers are not limited."""
        self._check_open()
        current = self._iteration() if self._iteration is not None else None
        if (
            current is not None
            and current.running
            and current.owner is not threading.current_thread()
            and current.owner.is_alive()
        ):
            raise StreamerError(
                f"this handle is being iterated by thread {current.owner.name!r}: a handle streams one "
                "pass at a time (open another handle, or share the iterator)",
                path=self._checkpoint.paths[0],
            )
        self._stop()
        ordered = self._order == "checkpoint"
        if self._group is not None:  # every rank plans from a confirmed open
            refs = list(self.checkpoint.refs())
            exchange = self._new_exchange(refs, self._group, ordered=ordered, keep_all=keep_all)
            iteration = _Iteration(exchange.results())
        else:
            run = self._new_run(list(self._checkpoint.refs()), ordered=ordered, keep_all=keep_all)
            iteration = _Iteration(self._confirmed_results(run, ordered=ordered, keep_all=keep_all))
            self._run, self._exchange = run, None
        self._iteration = weakref.ref(iteration)
        return iteration

    def _confirmed_results(
        self, run: Run | InlineRun, *, ordered: bool, keep_all: bool
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The results of ``run``, a pass over every tensor, handed on once the open it was planned
        from is confirmed. From a provisional open the run reads at once but its storage credits
        nothing before the answer; if the source changed, the run ends (``StaleOpen``) before
        anything is handed on, and a pass over the fresh checkpoint takes its place."""
        while True:  # twice at most: the first answer leaves the checkpoint confirmed
            results = run.results()
            try:
                first = next(results, None)
                replanned = self._confirm()
            except StaleOpen:
                if not self._confirm():
                    raise  # only a changed source ends a run so
                replanned = True
            except BaseException:  # S3's answer was an error (the run has read nothing yet)
                results.close()
                raise
            if not replanned:
                break
            results.close()
            run = self._new_run(list(self._checkpoint.refs()), ordered=ordered, keep_all=keep_all)
            self._run = run
        if first is not None:
            yield first
            del first  # the consumer's reference alone keeps it (memory_limit counts on that)
            yield from results

    def _new_run(
        self, refs: Sequence[TensorRef], *, ordered: bool, keep_all: bool = False
    ) -> Run | InlineRun:
        """A direct read into CPU memory (small runs of local files on the caller's thread), or a
        staged one through the ring where a copy engine is needed.

        The staged ring is bounded by ``memory_limit`` even when everything is kept: the tensors
        live on the device, the limit bounds host memory.
        """
        engine = copy_engine.staged_engine(self.device)
        if engine is None:
            if self._inline_reads and fits_inline(refs, self.config, keep_all=keep_all):
                return InlineRun(self._checkpoint, refs, self.config, keep_all=keep_all)
            config = dataclasses.replace(self.config, memory_limit=UNLIMITED) if keep_all else self.config
            cpu = functools.partial(
                CpuSink,
                config,
                one_receiver=self._storage.one_receiver,
                request_bytes=self._storage.read_cost.request_bytes,
                file_grid=self._storage.file_grid,
            )
            return Run(self._checkpoint, refs, config, cpu, ordered=ordered, storage=self._storage)
        staging = Staging(self.device, engine, functools.partial(NewMemory, self.device), self._rings)
        return _staged_run(self._checkpoint, refs, self.config, staging, self._storage, ordered=ordered)

    @property
    def _inline_reads(self) -> bool:
        """Whether small runs may be read on the caller's thread: local files the engine would read
        by path, unless ``io_mode="direct"`` asks for O_DIRECT."""
        return self._storage.reads_in_engine and self.config.io_mode != "direct"

    def _stop(self) -> None:
        iteration = self._iteration() if self._iteration is not None else None
        if iteration is not None:
            iteration.close()

    def close(self) -> None:
        """Stops a pass in progress and releases its threads, files, buffers and host ring. Reading
        afterwards is a ``FileClosedError``; what the open learned (``keys``, ``metadata``) and the
        last read's ``metrics`` stay. Idempotent."""
        self._closed = True
        self._stop()
        if self._walk is not None:
            self._walk.clear()
        self._rings.clear()
        self._storage.close()

    def __enter__(self) -> Streamer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def _new_tensor(
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


def open(
    source: SourceArg,
    device: str | int | torch.device = "cpu",
    *,
    config: StreamerConfig | None = None,
    order: Order = "completion",
    group: dist.ProcessGroup | None = None,
) -> Streamer:
    """Opens a checkpoint: a file, a list of files, a directory or a ``*.index.json``.

    ``group``: iterating loads with the ranks of this process group (see ``streamer.group``).
    """
    return Streamer(source, device=device, config=config, order=order, group=group)


def load(
    source: SourceArg,
    device: str | int | torch.device = "cpu",
    *,
    config: StreamerConfig | None = None,
    progress: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, keyed in checkpoint order.

    The result holds everything, so for CPU ``memory_limit`` does not apply here (use
    ``open`` to stream under a limit); for a GPU it bounds the host staging ring.
    ``progress`` shows a bytes and GB/s bar on stderr (tqdm's when it is installed).
    ``group``: every rank of this ``torch.distributed`` group calls ``load`` for the same
    checkpoint; each reads about ``1/N`` of the bytes and receives the rest (``streamer.group``).
    """
    with Streamer(source, device=device, config=config, group=group) as handle:
        loaded: dict[str, torch.Tensor] = {}
        # The bar's total from the checkpoint as opened: asking ``nbytes`` would wait for a
        # provisional open to be confirmed, which the pass itself does while reading.
        with ByteProgress(handle._checkpoint.nbytes, enabled=progress) as bar:
            for name, tensor in handle._iterate(keep_all=True):
                loaded[name] = tensor
                bar.update(tensor.nbytes)
        names = handle.keys()
    return {name: loaded[name] for name in names}


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
    config = config if config is not None else StreamerConfig()
    source = as_source(source)
    tensors = _destination(dest)
    with open_storage(source, config) as storage:
        checkpoint = read_checkpoint(storage, source)
        if group is not None:  # every rank plans from a confirmed open
            checkpoint = confirmed(storage, checkpoint)
        # From a provisional open the load reads at once; nothing reaches ``dest`` before the
        # storage confirms it, and if the source changed the load runs again from the fresh one.
        try:
            incompatible = _load_into(tensors, storage, checkpoint, config, strict, group)
        except StreamerError:
            fresh = confirmed(storage, checkpoint)
            if fresh is checkpoint:
                raise
        else:
            fresh = confirmed(storage, checkpoint)
            if fresh is checkpoint:
                return incompatible
        return _load_into(tensors, storage, fresh, config, strict, group)


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
) -> IncompatibleKeys:
    missing = [name for name in dest if name not in checkpoint.tensors]
    unexpected = [name for name in checkpoint.tensors if name not in dest]
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected, paths=checkpoint.paths)
    if group is not None:
        _exchange_into(dest, storage, checkpoint, config, group)
        return IncompatibleKeys(missing, unexpected)
    by_device: dict[torch.device, list[str]] = {}
    for name in dest:
        if name in checkpoint.tensors:
            _check_destination(checkpoint, name, dest[name])
            by_device.setdefault(dest[name].device, []).append(name)
    rings = RingCache()
    for device, names in by_device.items():
        _fill(storage, checkpoint, {name: dest[name] for name in names}, parse_device(device), config, rings)
    return IncompatibleKeys(missing, unexpected)


def _exchange_into(
    dest: Mapping[str, torch.Tensor],
    storage: Storage,
    checkpoint: Checkpoint,
    config: StreamerConfig,
    group: dist.ProcessGroup,
) -> None:
    """``load_into`` with a group: the tensors both sides have, in checkpoint order, assembled in place."""
    names = [name for name in checkpoint.tensors if name in dest]
    for name in names:
        _check_destination(checkpoint, name, dest[name])
        if not dest[name].is_contiguous():
            path = checkpoint.headers[checkpoint.tensors[name].file].path
            raise ConfigError("a group load fills contiguous tensors only", path=path, tensor=name)
    refs = [checkpoint.tensors[name] for name in names]
    from streamer.group.exchange import GroupExchange

    exchange = GroupExchange(
        checkpoint, storage, refs, group, config, lambda p: dest[names[p]], ordered=False
    )
    for _ in exchange.results():
        pass


def _check_destination(checkpoint: Checkpoint, name: str, tensor: object) -> None:
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


def _fill(
    storage: Storage,
    checkpoint: Checkpoint,
    dest: Mapping[str, torch.Tensor],
    device: torch.device,
    config: StreamerConfig,
    rings: RingCache,
) -> None:
    """Loads the tensors of one device; zero-size ones have nothing to read."""
    refs = [checkpoint.tensors[name] for name in dest if checkpoint.tensors[name].entry.nbytes > 0]
    engine = copy_engine.staged_engine(device) or copy_engine.ThreadCopyEngine()
    staging = Staging(device, engine, functools.partial(ExistingTensors, dest), rings)
    for _ in _staged_run(checkpoint, refs, config, staging, storage, ordered=False).results():
        pass


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
    config = config.for_staged()
    sink = functools.partial(
        StagedSink,
        staging,
        config,
        request_bytes=storage.read_cost.request_bytes,
        reads_in_flight=storage.reads_in_flight(config),
    )
    return Run(checkpoint, refs, config, sink, ordered=ordered, storage=storage)

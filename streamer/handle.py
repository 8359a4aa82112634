"""The open handle, ``safe_open``-style: ``streamer.open`` returns one."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import torch

from streamer.backends import open_storage
from streamer.backends.base import ReadCost, StaleOpen
from streamer.backends.sources import SourceArg, as_source
from streamer.config import StreamerConfig, default_config
from streamer.destinations import parse_device
from streamer.destinations.budget import HeldTensors, over_limit_message, streaming_budget, warn_from_caller
from streamer.destinations.ring import RingCache
from streamer.errors import ConfigError, FileClosedError, StreamerError
from streamer.format.safetensors import TensorEntry
from streamer.observe.events import LoadRecord, report
from streamer.observe.progress import ByteProgress
from streamer.plan.checkpoint import Checkpoint, KeySelection, TensorRef, confirmed, read_checkpoint
from streamer.plan.readahead import MAX_WINDOW_BYTES, KeyWalk
from streamer.run.assembly import new_run, new_tensor
from streamer.run.driver import Run
from streamer.run.inline import InlineRun

if TYPE_CHECKING:  # a group load imports them (torch.distributed alone costs ~40 ms)
    import torch.distributed as dist

    from streamer.group.exchange import GroupExchange
    from streamer.plan.slicing import Packing

Order = Literal["completion", "checkpoint"]
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _recorded(method: _Method) -> _Method:
    """A read of the handle whose failure is the load's (its one event says so)."""

    @functools.wraps(method)
    def recorded(self: Streamer, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as error:
            self._record.fail(error)
            raise

    return cast(_Method, recorded)


class _Iteration:
    """One pass over a run; ``close()`` ends it for good and frees what its generator holds.

    Threads calling ``next`` take turns (each tensor goes to one of them); ``close`` from another
    thread waits for the turn in progress, so a generator is never entered twice at once.
    """

    def __init__(
        self,
        results: Generator[tuple[str, torch.Tensor], None, None],
        failed: Callable[[BaseException], None],
    ) -> None:
        self._results = results
        self._failed = failed
        self._stopped = False
        self._turn = threading.Lock()
        self.owner = threading.current_thread()

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        with self._turn:
            if self._stopped:
                raise StreamerError("this iteration was stopped: the handle was closed or iterated again")
            try:
                return next(self._results)
            except StopIteration:
                raise
            except Exception as error:
                self._failed(error)
                raise

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

    With ``keys`` (names, or a test a name passes), the handle is the checkpoint less every other
    tensor: ``keys()``, ``nbytes``, iteration and ``get_tensor`` know only those, and no byte of
    the others is read. Ranks of a group may each select different tensors (an expert-parallel
    rank its own experts): bytes that several ranks want are read once.
    """

    def __init__(
        self,
        source: SourceArg,
        device: str | int | torch.device = "cpu",
        *,
        config: StreamerConfig | None = None,
        order: Order = "completion",
        group: dist.ProcessGroup | None = None,
        keys: KeySelection | None = None,
    ) -> None:
        if order not in ("completion", "checkpoint"):
            raise ConfigError(f"order must be 'completion' or 'checkpoint', got {order!r}")
        if isinstance(keys, (str, bytes)):
            raise ConfigError(f"keys takes tensor names (a list or set) or a test on a name, got {keys!r}")
        self.device = parse_device(device)
        self.config = config if config is not None else default_config()
        self._order = order
        self._keys = keys
        source = as_source(source)
        self._record = LoadRecord(source, self.device.type)  # the load's one event
        try:
            # The storage session (for S3 a client: a thread, a loop, sockets) serves every run of
            # this handle; closed by close(), or when the handle is collected without it.
            self._storage = open_storage(source, self.config)
            weakref.finalize(self, self._storage.close)
            try:
                # Maybe provisional (a cache's note of the source): a full pass reads from it at
                # once, everything else waits for the storage to confirm it (``checkpoint``).
                self._checkpoint = self._selected(read_checkpoint(self._storage, source))
            except BaseException:
                self._storage.close()
                raise
        except Exception as error:  # a load that failed at its open: its one event says so
            self._record.fail(error)
            report(self._record, self.config)
            raise
        self._provisional = True
        self._group = group
        self._run: Run | InlineRun | None = None  # the last read, for metrics
        self._exchange: GroupExchange | None = None  # the last read's, if it was a group read
        self._unrecorded = False  # the last read is not yet in the load's record
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
        if self._exchange is not None:
            return self._exchange.measured()
        return {} if self._run is None else self._run.metrics.as_dict()

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
        replaced = checkpoint is not self._checkpoint
        self._checkpoint = self._selected(checkpoint) if replaced else checkpoint
        return replaced

    def _selected(self, checkpoint: Checkpoint) -> Checkpoint:
        return checkpoint if self._keys is None else checkpoint.only(self._keys)

    @property
    def read_cost(self) -> ReadCost:
        """What one more read request costs this handle's storage."""
        return self._storage.read_cost

    def read_cost_of(self, ref: TensorRef) -> ReadCost:
        """What one more read request costs reading ``ref`` now (how ``get_slice`` plans): local
        bytes in the page cache cost less per request than bytes on the device."""
        return self._storage.read_cost_of(self.checkpoint.files[ref.file], (ref.entry.begin, ref.entry.end))

    @_recorded
    def read(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """The tensors of ``refs``, in the order given, from one run that keeps them all.

        A ref may be a byte range of one of this checkpoint's tensors under a name of its own
        (``rows``).
        """
        self._check_open()
        run = self._new_run(refs, ordered=False, keep_all=True)
        self._use(run, None)
        got = dict(run.results())
        return [got[ref.entry.name] for ref in refs]

    @_recorded
    def read_packed(self, ref: TensorRef, packing: Packing) -> torch.Tensor:
        """The ranges of ``ref``'s tensor that ``packing`` lays out, back to back in one CPU buffer
        (uint8), read by one run of the handle's storage: how ``get_slice`` reads a shard."""
        self._check_open()
        from streamer.run.packed import PackedSink  # get_slice's strided reads only

        sink = functools.partial(PackedSink, packing, hugepages=self.config.hugepages)
        run = Run(self.checkpoint, [ref], self.config, sink, ordered=False, storage=self._storage)
        self._use(run, None)
        ((_, buffer),) = run.results()
        return buffer

    @_recorded
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
            functools.partial(new_tensor, refs, self.device, self.config.hugepages),
            ordered=ordered,
            new_tensors=self.device.type == "cpu",
            keep_all=keep_all,
        )
        self._use(None, exchange)
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

    @_recorded
    def get_tensor(self, name: str) -> torch.Tensor:
        """Reads one tensor (all workers share it when it is large); an iteration may be under way.

        Called for the keys in ``keys()`` order, it reads the ones that follow ahead, in windows
        (``streamer.plan.readahead``).
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
        self._use(run, None)
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

    def load_all(self, *, progress: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor, keyed in checkpoint order: what ``streamer.load`` returns. The result holds
        everything, so on the CPU ``memory_limit`` does not bound it; ``progress`` shows a bar."""
        loaded: dict[str, torch.Tensor] = {}
        # The bar's total from the checkpoint as opened: asking ``nbytes`` would wait for a
        # provisional open to be confirmed, which the pass itself does while reading.
        with ByteProgress(self._checkpoint.nbytes, enabled=progress) as bar:
            for name, tensor in self._iterate(keep_all=True):
                loaded[name] = tensor
                bar.update(tensor.nbytes)
        return {name: loaded[name] for name in self.keys()}

    @_recorded
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
            iteration = _Iteration(exchange.results(), self._record.fail)
        else:
            run = self._new_run(list(self._checkpoint.refs()), ordered=ordered, keep_all=keep_all)
            iteration = _Iteration(
                self._confirmed_results(run, ordered=ordered, keep_all=keep_all), self._record.fail
            )
            self._use(run, None)
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
            self._use(run, None)
        if first is not None:
            yield first
            del first  # the consumer's reference alone keeps it (memory_limit counts on that)
            yield from results

    def _new_run(
        self, refs: Sequence[TensorRef], *, ordered: bool, keep_all: bool = False
    ) -> Run | InlineRun:
        return new_run(
            self._checkpoint,
            self._storage,
            refs,
            self.config,
            self.device,
            self._rings,
            ordered=ordered,
            keep_all=keep_all,
        )

    def _use(self, run: Run | InlineRun | None, exchange: GroupExchange | None) -> None:
        """Makes a new read the handle's current one (``metrics``); the read it replaces goes into
        the load's record first."""
        self._record_last()
        self._run, self._exchange = run, exchange
        self._unrecorded = True

    def _record_last(self) -> None:
        if self._unrecorded:
            self._record.add(self.metrics)
            self._unrecorded = False

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
        self._record_last()
        report(self._record, self.config)
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

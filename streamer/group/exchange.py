"""Runs a group load on one rank: learns what every rank wants, reads this rank's share of the
plan through an ordinary run, sends each piece from its reader to the ranks that want it, and
assembles this rank's tensors from the pieces.

Reading overlaps exchanging: the rank's own run queues every read its memory limit allows as
soon as a piece is taken from it, so the next pieces are read by the reader threads while this
thread exchanges. Every collective is waited on for at most ``group_timeout`` seconds, and
before each round of pieces every rank says whether its read of that round failed (one small
``all_reduce``): a rank that fails makes the others raise a ``StreamerError`` at once, a rank
that dies or stops calling makes them raise within the timeout, never hang.

How pieces move is agreed by all ranks before the first read (``_connect``):

- **shared copy**: ranks of a CPU group on one host whose load may hold every wanted byte at once
  (``load``, ``group_read``, or a checkpoint within the memory limit) read their shares straight
  into one tmpfs copy of the checkpoint (``shared.py``, ``region.py``); a rank's tensors are
  copy-on-write views of it, so no byte is copied and the host holds the checkpoint once;
- **shared outboxes**: on one host under a smaller limit, the reader copies a piece into its
  outbox before the round's status ``all_reduce`` and the ranks that want it copy it out after;
- **collectives**: otherwise (ranks on other hosts, a GPU group, no tmpfs), a piece every rank
  wants is broadcast and one that only some want goes point to point, backend-agnostic: in CPU
  buffers for gloo, on the rank's CUDA device for NCCL.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from streamer.backends.base import Storage
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.destinations.budget import streaming_budget
from streamer.destinations.buffers import tensor_view
from streamer.errors import ConfigError, StreamerError
from streamer.format import DTYPES
from streamer.format.safetensors import TensorEntry
from streamer.group.identity import check_agreement, identity_values
from streamer.group.plan import GroupPlan, Piece, Want, coalesced, make_plan, union_bytes
from streamer.group.region import RegionSink
from streamer.group.shared import SharedOutboxes, SharedRegion, private_directory, region_layout
from streamer.plan.checkpoint import Checkpoint, TensorRef
from streamer.run.assembly import check_destination
from streamer.run.cpu import CpuSink
from streamer.run.driver import Run, SinkFor

_TRANSPORTS: dict[type, str] = {
    SharedRegion: "shared copy",
    SharedOutboxes: "shared outboxes",
    type(None): "collectives",
}

Destination = Callable[[int], torch.Tensor]
"""The tensor this rank's wanted ref at a position is assembled in."""

_PIECE_MAX = 64 << 20  # pieces large enough that a collective costs little per byte
# Through shared memory a piece costs one small all_reduce per round, and every byte of the
# buffers it passes through is fresh memory to fault in once: smaller pieces, smaller buffers.
_SHARED_PIECE_MAX = 8 << 20
_PIECE_MIN = 128 << 10


class GroupExchange:
    """This rank's part in one group load of ``refs``; iterate ``results()``."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        storage: Storage,
        refs: Sequence[TensorRef],
        group: dist.ProcessGroup,
        config: StreamerConfig,
        destination: Destination,
        *,
        ordered: bool,
        new_tensors: bool = False,
        keep_all: bool = False,
    ) -> None:
        """``new_tensors``: ``destination`` makes fresh CPU tensors, which views of the host's
        shared copy may replace; ``keep_all``: the caller keeps every tensor (``load``), so the shared
        copy may hold them all whatever the memory limit."""
        self._checkpoint = checkpoint
        self._storage = storage
        self._config = config
        self._refs = refs
        self._group = group
        self._rank = dist.get_rank(group)
        if self._rank < 0:
            raise ConfigError("this process is not a member of the group it was given")
        self._world = dist.get_world_size(group)
        self._timeout = datetime.timedelta(seconds=config.group_timeout)
        self._ordered = ordered
        self._destination = destination
        self._new_tensors = new_tensors
        self._keep_all = keep_all
        self._wire = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(group) == "nccl"
            else torch.device("cpu")
        )
        self._plan: GroupPlan | None = None
        self.run: Run | None = None  # this rank's reads, once planned
        self._pending: set[int] = set()  # whole, not yet handed out
        self._next_position = 0  # ordered: the next position to hand out
        self.exchange_seconds = 0.0
        self.received_bytes = 0
        self.transport = _TRANSPORTS[type(None)]  # until the ranks agree on one

    def stats(self) -> dict[str, Any]:
        """What the exchange did on this rank, for ``Streamer.metrics``."""
        plan = self._plan
        return {
            "world_size": self._world,
            "rank": self._rank,
            "pieces": 0 if plan is None else len(plan.pieces),
            "share_bytes": 0 if plan is None else plan.share_bytes(self._rank),
            "received_bytes": self.received_bytes,
            "transport": self.transport,
            "exchange_seconds": self.exchange_seconds,
        }

    def measured(self) -> dict[str, Any]:
        """The run's ``metrics`` with the exchange's ``stats`` under ``group`` ({} before a run);
        ``tensors`` and ``bytes`` are what this rank was handed, not the pieces it read."""
        if self.run is None:
            return {}
        handed = {"tensors": len(self._refs), "bytes": sum(ref.entry.nbytes for ref in self._refs)}
        return {**self.run.metrics.as_dict(), **handed, "group": self.stats()}

    def results(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        return self._exchange()  # closes at the end, on error, or when abandoned

    def close(self) -> None:
        if self.run is not None:
            self.run.close()

    def _exchange(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        wants = self._gather_wants()
        union = union_bytes(wants)
        shared_likely = self._wire.type == "cpu" and self._config.group_shm_dir is not None
        largest = _SHARED_PIECE_MAX if shared_likely else _PIECE_MAX
        piece_bytes = _piece_bytes(self._config, union, self._world, largest)
        self._plan = plan = make_plan(wants, piece_bytes)
        link = self._connect(plan, union)
        self.transport = _TRANSPORTS[type(link)]
        try:
            yield from self._rounds(plan, link, piece_bytes)
        finally:
            self.close()  # no read may land in a mapping after it is gone
            if link is not None:
                link.close()

    def _rounds(
        self, plan: GroupPlan, link: SharedRegion | SharedOutboxes | None, piece_bytes: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Reads this rank's share and moves the plan's pieces, a round at a time."""
        region = link if isinstance(link, SharedRegion) else None
        outboxes = link if isinstance(link, SharedOutboxes) else None
        views = region is not None and self._new_tensors  # tensors are views of the region
        self.run = self._share_run(plan, region, piece_bytes)
        own = self.run.results()
        left = [0] * len(self._refs)
        for piece in plan.pieces:
            for part in piece.parts:
                if part.rank == self._rank:
                    left[part.position] += 1
        tensors: dict[int, torch.Tensor] = {}
        whole = [p for p, ref in enumerate(self._refs) if ref.entry.nbytes == 0]
        for position in whole:
            tensors[position] = self._destination(position)
        pieces = plan.pieces
        # Through the collectives, pieces from other ranks land in one reused buffer: fresh memory
        # per piece would fault in every page again (~16k faults per 64 MiB).
        inbox = torch.empty(
            max((p.nbytes for p in pieces), default=0) if link is None else 0,
            dtype=torch.uint8,
            device=self._wire,
        )
        for round_number, round_ in enumerate(plan.rounds()):
            held, failure = self._read_round(own, [i for i in round_ if pieces[i].reader == self._rank])
            if outboxes is not None and failure is None:
                self._post(outboxes, held, round_number)
            self._check_round(failure)
            for index in round_:
                piece = pieces[index]
                buffer = held.pop(index, None)
                if self._rank not in piece.wanted_by:
                    continue  # read for others only, or neither read nor wanted here
                if piece.reader != self._rank:
                    self.received_bytes += piece.nbytes
                if views:
                    buffer = None  # nothing to move: the bytes are in place
                elif region is not None:
                    buffer = region.view(piece.file, piece.begin, piece.end) if buffer is None else buffer
                elif outboxes is not None:
                    buffer = outboxes.piece(index, round_number) if buffer is None else buffer
                else:
                    buffer = inbox[: piece.nbytes] if buffer is None else buffer
                    self._send(buffer, index, piece)
                for part in piece.parts:
                    if part.rank != self._rank:
                        continue
                    left[part.position] -= 1
                    if left[part.position] == 0:
                        whole.append(part.position)
                    if buffer is None:
                        continue  # handed out as a view of the region once whole
                    if part.position not in tensors:
                        tensors[part.position] = self._destination(part.position)
                    target = _bytes_of(tensors[part.position])
                    target[part.tensor_offset : part.tensor_offset + part.nbytes].copy_(
                        buffer[part.piece_offset : part.piece_offset + part.nbytes]
                    )
                del buffer  # a view of shared memory must not outlive the mapping
            if views:
                assert region is not None
                for position in whole:
                    tensors.setdefault(position, self._region_tensor(region, position))
            yield from self._deliver(whole, tensors)
            whole = []
        yield from self._deliver(whole, tensors)

    def _share_run(self, plan: GroupPlan, region: SharedRegion | None, piece_bytes: int) -> Run:
        """The run that reads this rank's share: into the host's shared copy, or CPU buffers."""
        storage = self._storage
        mine = [_piece_ref(index, plan.pieces[index]) for index in plan.share(self._rank)]
        if region is not None:
            sink: SinkFor = functools.partial(
                RegionSink,
                region,
                self._config,
                request_bytes=storage.read_cost.request_bytes,
                delivery=storage.delivery,
            )
            return Run(self._checkpoint, mine, self._config, sink, ordered=True, storage=storage)
        config = _share_config(self._config, storage, piece_bytes)
        sink = functools.partial(
            CpuSink,
            config,
            delivery=storage.delivery,
            request_bytes=storage.read_cost.request_bytes,
        )
        return Run(self._checkpoint, mine, config, sink, ordered=True, storage=storage)

    def _region_tensor(self, region: SharedRegion, position: int) -> torch.Tensor:
        ref = self._refs[position]
        return tensor_view(region.view(ref.file, ref.entry.begin, ref.entry.end), 0, ref.entry)

    def _deliver(
        self, whole: list[int], tensors: dict[int, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Hands out the tensors that became whole: at once, or in the order asked if ``ordered``."""
        if not self._ordered:
            for position in whole:
                # No local name for the tensor: the frame must not outlive the consumer's reference.
                yield self._refs[position].entry.name, tensors.pop(position)
            return
        self._pending.update(whole)
        while self._next_position in self._pending:
            position = self._next_position
            self._pending.remove(position)
            self._next_position += 1
            yield self._refs[position].entry.name, tensors.pop(position)

    def _gather_wants(self) -> list[list[Want]]:
        """Every rank's wanted spans, the same list on every rank (two small all_gathers).

        Each rank prefixes its spans with the identity of the checkpoint it opened (``identity``):
        ranks that opened different checkpoints would mix bytes up, so that is a ``ConfigError``
        on all, before any byte moves.
        """
        spans = [(r.file, r.entry.begin, r.entry.end) for r in self._refs]
        identity = identity_values(self._checkpoint, self._storage, full=self._config.group_verify == "full")
        mine = torch.tensor([len(identity), *identity, *(v for s in spans for v in s)], dtype=torch.int64)
        doing = "exchanging what each rank wants"
        counts = self._all_gather(torch.tensor([mine.numel()], dtype=torch.int64), doing)
        longest = max(int(c.item()) for c in counts)
        padded = torch.zeros(longest, dtype=torch.int64)
        padded[: mine.numel()] = mine
        every = [
            values[: int(count.item())].tolist()
            for values, count in zip(self._all_gather(padded, doing), counts, strict=True)
        ]
        check_agreement([values[1 : 1 + values[0]] for values in every], self._checkpoint.paths)
        wants = []
        for values in every:
            flat = values[1 + values[0] :]
            wants.append([(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)])
        return wants

    def _all_gather(self, tensor: torch.Tensor, doing: str) -> list[torch.Tensor]:
        sent = tensor.to(self._wire)
        every = [torch.empty_like(sent) for _ in range(self._world)]
        self._wait(dist.all_gather(every, sent, group=self._group, async_op=True), doing)
        return [t.cpu() for t in every]

    def _read_round(
        self, own: Iterator[tuple[str, torch.Tensor]], mine: list[int]
    ) -> tuple[dict[int, torch.Tensor], BaseException | None]:
        """This rank's pieces of a round from its run, or the error its run raised."""
        held: dict[int, torch.Tensor] = {}
        try:
            for index in mine:
                name, tensor = next(own)
                assert name == _piece_name(index), (name, index)
                held[index] = tensor.to(self._wire)
        except Exception as error:
            return {}, error
        return held, None

    def _connect(self, plan: GroupPlan, union: int) -> SharedRegion | SharedOutboxes | None:
        """How pieces move, agreed by every rank: the host's shared copy, where the ranks share a
        host and this load may hold every wanted byte at once (the caller keeps everything, or it
        fits the memory limit); else shared-memory outboxes; else (other hosts, a GPU group, no
        tmpfs) the group's collectives."""
        if self._wire.type != "cpu" or self._world == 1:
            return None
        root = self._config.group_shm_dir
        directory = None if root is None else private_directory(root)
        budget = streaming_budget(self._config, [r.entry.nbytes for r in self._refs]).limit
        whole_fits = self._keep_all or budget is None or union <= budget
        votes = self._all_gather(
            torch.tensor([directory is not None, whole_fits and union > 0], dtype=torch.int64),
            "agreeing how pieces move",
        )
        if directory is None or not all(int(v[0]) for v in votes):
            return None
        if all(int(v[1]) for v in votes):
            layout = region_layout(coalesced([(p.file, p.begin, p.end) for p in plan.pieces]))
            region = SharedRegion.connect(layout, self._rank, directory, self._all_gather)
            if region is not None:
                return region
        return SharedOutboxes.connect(plan, self._rank, directory, self._all_gather)

    def _post(self, shared: SharedOutboxes, held: dict[int, torch.Tensor], round_number: int) -> None:
        started = time.perf_counter()
        for index, piece in held.items():
            shared.post(index, round_number, piece)
        self.exchange_seconds += time.perf_counter() - started

    def _check_round(self, failure: BaseException | None) -> None:
        """Every rank says whether its reads failed before any byte moves."""
        status = torch.zeros(self._world, dtype=torch.int32, device=self._wire)
        status[self._rank] = 0 if failure is None else 1
        started = time.perf_counter()
        self._wait(dist.all_reduce(status, group=self._group, async_op=True), "exchanging read status")
        self.exchange_seconds += time.perf_counter() - started
        failed = [rank for rank, flag in enumerate(status.tolist()) if flag]
        if failure is not None:
            raise failure
        if failed:
            raise StreamerError(
                f"rank(s) {failed} of the group failed to read their share; this rank stops too"
            )

    def _send(self, buffer: torch.Tensor, index: int, piece: Piece) -> None:
        """From the reader to the ranks that want the piece: a broadcast when that is every rank."""
        started = time.perf_counter()
        reader = dist.get_global_rank(self._group, piece.reader)
        wanted = piece.wanted_by
        if len(set(wanted) | {piece.reader}) == self._world:
            works = [dist.broadcast(buffer, src=reader, group=self._group, async_op=True)]
        elif self._rank == piece.reader:
            works = [
                dist.isend(buffer, dst=dist.get_global_rank(self._group, rank), group=self._group, tag=index)
                for rank in wanted
                if rank != self._rank
            ]
        else:
            works = [dist.irecv(buffer, src=reader, group=self._group, tag=index)]
        for work in works:
            self._wait(work, "exchanging a piece")
        self.exchange_seconds += time.perf_counter() - started

    def _wait(self, work: dist.Work | None, doing: str) -> None:
        assert work is not None
        try:
            work.wait(timeout=self._timeout)
        except Exception as error:  # gloo and NCCL raise RuntimeError subclasses of their own
            raise StreamerError(
                f"group exchange failed while {doing} (rank {self._rank}; a rank failed, died or did not "
                f"make the same call within group_timeout={self._timeout.total_seconds():g}s): {error}"
            ) from error


def exchange_into(
    dest: Mapping[str, torch.Tensor],
    storage: Storage,
    checkpoint: Checkpoint,
    config: StreamerConfig,
    group: dist.ProcessGroup,
) -> dict[str, Any]:
    """``load_into`` with a group: the checkpoint's tensors named in ``dest``, in checkpoint order,
    assembled in place (so they must be contiguous); what the exchange measured."""
    names = [name for name in checkpoint.tensors if name in dest]
    for name in names:
        check_destination(checkpoint, name, dest[name])
        if not dest[name].is_contiguous():
            path = checkpoint.headers[checkpoint.tensors[name].file].path
            raise ConfigError("a group load fills contiguous tensors only", path=path, tensor=name)
    refs = [checkpoint.tensors[name] for name in names]
    exchange = GroupExchange(
        checkpoint, storage, refs, group, config, lambda p: dest[names[p]], ordered=False
    )
    for _ in exchange.results():
        pass
    return exchange.measured()


def _piece_bytes(config: StreamerConfig, total: int, world_size: int, largest: int) -> int:
    """About eight pieces per rank (shares balanced within a sixteenth), at most a quarter of an
    explicit memory limit."""
    size = min(largest, max(_PIECE_MIN, -(-total // (8 * world_size))))
    limit = config.explicit_memory_limit
    return size if limit is None else max(DIRECT_IO_ALIGNMENT, min(size, limit // 4))


def _share_config(config: StreamerConfig, storage: Storage, piece_bytes: int) -> StreamerConfig:
    """The config this rank reads its share under. Without a limit of the user's, the auto budget
    (at least 1 GiB) would let the whole share land in fresh memory; two pieces being exchanged
    plus a round of reads keep every reader busy, and the run's buffers come back round after
    round, where first touch (zeroing pages) is what fresh memory costs."""
    if config.memory_limit is not None:
        return config
    return dataclasses.replace(config, memory_limit=2 * piece_bytes + storage.reads_in_flight(config))


def _piece_name(index: int) -> str:
    return f"<group piece {index}>"


def _piece_ref(index: int, piece: Piece) -> TensorRef:
    """A piece as a tensor of bytes, so an ordinary run reads it."""
    entry = TensorEntry(_piece_name(index), DTYPES["U8"], (piece.nbytes,), piece.begin, piece.end)
    return TensorRef(piece.file, entry)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1).view(torch.uint8)

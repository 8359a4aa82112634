"""Runs a group load on one rank: learns what every rank wants, reads this rank's share of the
plan through an ordinary run, sends each piece from its reader to the ranks that want it, and
assembles this rank's tensors from the pieces.

Reading overlaps exchanging: the rank's own run queues every read its memory limit allows as
soon as a piece is taken from it, so the next pieces are read by the reader threads while this
thread exchanges. Every collective is waited on for at most ``group_timeout`` seconds, and
before each round of pieces every rank says whether its read of that round failed (one small
``all_reduce``): a rank that fails makes the others raise a ``StreamerError`` at once, a rank
that dies or stops calling makes them raise within the timeout, never hang.

A piece every rank wants is broadcast; one that only some want goes point to point. Both are
backend-agnostic: pieces travel in CPU buffers for gloo and on the rank's CUDA device for NCCL.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from streamer.backends.base import Storage
from streamer.checkpoint import Checkpoint, TensorRef
from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.errors import ConfigError, StreamerError
from streamer.format import DTYPES
from streamer.format.safetensors import TensorEntry
from streamer.group.plan import GroupPlan, Piece, Span, make_plan, union_bytes
from streamer.run.cpu import CpuSink
from streamer.run.driver import Run
from streamer.selection import run_then_close

Destination = Callable[[int], torch.Tensor]
"""The tensor this rank's wanted ref at a position is assembled in."""

_PIECE_MAX = 64 << 20  # pieces large enough that a collective costs little per byte
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
    ) -> None:
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

    def stats(self) -> dict[str, Any]:
        """What the exchange did on this rank, for ``Streamer.metrics``."""
        plan = self._plan
        return {
            "world_size": self._world,
            "rank": self._rank,
            "pieces": 0 if plan is None else len(plan.pieces),
            "share_bytes": 0 if plan is None else plan.share_bytes(self._rank),
            "received_bytes": self.received_bytes,
            "exchange_seconds": self.exchange_seconds,
        }

    def results(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        return run_then_close(self._exchange(), self.close)

    def close(self) -> None:
        if self.run is not None:
            self.run.close()

    def _exchange(self) -> Iterator[tuple[str, torch.Tensor]]:
        wants = self._gather_wants()
        piece_bytes = _piece_bytes(self._config, union_bytes(wants), self._world)
        self._plan = plan = make_plan(wants, piece_bytes)
        cpu = functools.partial(
            CpuSink,
            self._config,
            one_receiver=self._storage.one_receiver,
            request_bytes=self._storage.read_cost.request_bytes,
            file_grid=self._storage.file_grid,
        )
        mine = [_piece_ref(index, plan.pieces[index]) for index in plan.share(self._rank)]
        self.run = Run(self._checkpoint, mine, self._config, cpu, ordered=True, storage=self._storage)
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
        # Pieces from other ranks land in one reused buffer: fresh memory per piece would fault in
        # every page again (~16k faults per 64 MiB), which was most of the exchange time measured.
        inbox = torch.empty(max((p.nbytes for p in pieces), default=0), dtype=torch.uint8, device=self._wire)
        for first in range(0, len(pieces), self._world):
            round_ = range(first, min(first + self._world, len(pieces)))
            held, failure = self._read_round(own, [i for i in round_ if pieces[i].reader == self._rank])
            self._check_round(failure)
            for index in round_:
                piece = pieces[index]
                buffer = held.pop(index, None)
                if self._rank not in piece.wanted_by and buffer is None:
                    continue  # neither read nor wanted here
                if buffer is None:
                    buffer = inbox[: piece.nbytes]
                self._send(buffer, index, piece)
                for part in piece.parts:
                    if part.rank != self._rank:
                        continue
                    if part.position not in tensors:
                        tensors[part.position] = self._destination(part.position)
                    target = _bytes_of(tensors[part.position])
                    target[part.tensor_offset : part.tensor_offset + part.nbytes].copy_(
                        buffer[part.piece_offset : part.piece_offset + part.nbytes]
                    )
                    left[part.position] -= 1
                    if left[part.position] == 0:
                        whole.append(part.position)
            yield from self._deliver(whole, tensors)
            whole = []
        yield from self._deliver(whole, tensors)

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

    def _gather_wants(self) -> list[list[Span]]:
        """Every rank's wanted spans, the same list on every rank (two small all_gathers).

        Each rank prefixes its spans with a fingerprint of the checkpoint's layout: ranks that
        opened different checkpoints would mix bytes up, so that is a ``ConfigError`` on all.
        """
        spans = [(r.file, r.entry.begin, r.entry.end) for r in self._refs]
        mine = torch.tensor(
            [layout_digest(self._checkpoint), *(v for s in spans for v in s)], dtype=torch.int64
        )
        doing = "exchanging what each rank wants"
        counts = self._all_gather(torch.tensor([mine.numel()], dtype=torch.int64), doing)
        longest = max(int(c.item()) for c in counts)
        padded = torch.zeros(longest, dtype=torch.int64)
        padded[: mine.numel()] = mine
        every = self._all_gather(padded, doing)
        if len({int(e[0].item()) for e in every}) != 1:
            raise ConfigError(
                "the ranks of the group opened different checkpoints (tensor names or byte layout "
                "differ): every rank must open the same one"
            )
        wants = []
        for values, count in zip(every, counts, strict=True):
            flat = values[1 : int(count.item())].tolist()
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

    def _check_round(self, failure: BaseException | None) -> None:
        """Every rank says whether its reads failed before any byte moves."""
        status = torch.zeros(self._world, dtype=torch.int32, device=self._wire)
        status[self._rank] = 0 if failure is None else 1
        self._wait(dist.all_reduce(status, group=self._group, async_op=True), "exchanging read status")
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
        if piece.reader != self._rank:
            self.received_bytes += piece.nbytes

    def _wait(self, work: dist.Work | None, doing: str) -> None:
        assert work is not None
        try:
            work.wait(timeout=self._timeout)
        except Exception as error:  # gloo and NCCL raise RuntimeError subclasses of their own
            raise StreamerError(
                f"group exchange failed while {doing} (rank {self._rank}; a rank failed, died or did not "
                f"make the same call within group_timeout={self._timeout.total_seconds():g}s): {error}"
            ) from error


def layout_digest(checkpoint: Checkpoint) -> int:
    """A 63-bit fingerprint of the checkpoint's tensors and where their bytes are."""
    h = hashlib.blake2b(digest_size=8)
    for name, ref in checkpoint.tensors.items():
        h.update(repr((name, ref.file, ref.entry.begin, ref.entry.end)).encode())
    return int.from_bytes(h.digest(), "little") >> 1


def _piece_bytes(config: StreamerConfig, total: int, world_size: int) -> int:
    """About eight pieces per rank (shares balanced within a sixteenth), at most a quarter of an
    explicit memory limit."""
    size = min(_PIECE_MAX, max(_PIECE_MIN, -(-total // (8 * world_size))))
    limit = config.explicit_memory_limit
    return size if limit is None else max(DIRECT_IO_ALIGNMENT, min(size, limit // 4))


def _piece_name(index: int) -> str:
    return f"<group piece {index}>"


def _piece_ref(index: int, piece: Piece) -> TensorRef:
    """A piece as a tensor of bytes, so an ordinary run reads it."""
    entry = TensorEntry(_piece_name(index), DTYPES["U8"], (piece.nbytes,), piece.begin, piece.end)
    return TensorRef(piece.file, entry)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1).view(torch.uint8)

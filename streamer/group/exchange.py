"""Runs a group plan on one rank: reads its share through an ordinary run, broadcasts each piece
from its reader, and assembles the wanted tensors from the pieces.

Reading overlaps exchanging: the rank's own run queues every read its memory limit allows as
soon as a piece is taken from it, so the next pieces are read by the reader threads while this
thread broadcasts. Every collective is waited on for at most ``group_timeout`` seconds, and
before each round of broadcasts every rank says whether its read of that round failed (one
small ``all_reduce``): a rank that fails makes the others raise a ``StreamerError`` at once, a
rank that dies or stops calling makes them raise within the timeout, never hang.

Collectives are backend-agnostic: pieces travel in CPU buffers for gloo and in buffers on the
rank's CUDA device for NCCL.
"""

from __future__ import annotations

import datetime
import functools
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
from streamer.group.plan import GroupPlan, Piece, make_plan
from streamer.run.cpu import CpuSink
from streamer.run.driver import Run
from streamer.selection import run_then_close

RunFor = Callable[[Sequence[TensorRef]], Run]
"""Makes this rank's ordered run over the refs of its pieces."""

Destination = Callable[[int], torch.Tensor]
"""The tensor the wanted ref at a position is assembled in."""


class GroupExchange:
    """One pass of a group plan on this rank; iterate ``results()``."""

    def __init__(
        self,
        plan: GroupPlan,
        refs: Sequence[TensorRef],
        group: dist.ProcessGroup,
        run_for: RunFor,
        destination: Destination,
        *,
        timeout: float,
        ordered: bool,
    ) -> None:
        self._plan = plan
        self._refs = refs
        self._group = group
        self._rank = dist.get_rank(group)
        self._timeout = datetime.timedelta(seconds=timeout)
        self._ordered = ordered
        self._destination = destination
        self._share = plan.share(self._rank)
        self.run = run_for([_piece_ref(index, plan.pieces[index]) for index in self._share])
        backend = dist.get_backend(group)
        self._wire = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self._pending: set[int] = set()  # whole, not yet handed out
        self._next_position = 0  # ordered: the next position to hand out
        self.exchange_seconds = 0.0
        self.received_bytes = 0

    def stats(self) -> dict[str, Any]:
        """What the exchange did on this rank, for ``Streamer.metrics``."""
        return {
            "world_size": self._plan.world_size,
            "rank": self._rank,
            "pieces": len(self._plan.pieces),
            "share_bytes": self._plan.share_bytes(self._rank),
            "received_bytes": self.received_bytes,
            "exchange_seconds": self.exchange_seconds,
        }

    def results(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        return run_then_close(self._exchange(), self.run.close)

    def _exchange(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._check_same_plan()
        own = self.run.results()
        left = [0] * len(self._refs)
        for piece in self._plan.pieces:
            for part in piece.parts:
                left[part.position] += 1
        tensors: dict[int, torch.Tensor] = {}
        whole = [p for p, ref in enumerate(self._refs) if ref.entry.nbytes == 0]
        for position in whole:
            tensors[position] = self._destination(position)
        world = self._plan.world_size
        pieces = self._plan.pieces
        for first in range(0, len(pieces), world):
            round_ = range(first, min(first + world, len(pieces)))
            held, failure = self._read_round(own, [i for i in round_ if pieces[i].reader == self._rank])
            self._check_round(failure)
            for index in round_:
                piece = pieces[index]
                buffer = held.pop(index, None)
                if buffer is None:
                    buffer = torch.empty(piece.nbytes, dtype=torch.uint8, device=self._wire)
                self._broadcast(buffer, piece)
                for part in piece.parts:
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
        """Hands out the tensors that became whole: at once, or in checkpoint order if ``ordered``."""
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
        status = torch.zeros(self._plan.world_size, dtype=torch.int32, device=self._wire)
        status[self._rank] = 0 if failure is None else 1
        self._wait(dist.all_reduce(status, group=self._group, async_op=True), "exchanging read status")
        failed = [rank for rank, flag in enumerate(status.tolist()) if flag]
        if failure is not None:
            raise failure
        if failed:
            raise StreamerError(
                f"rank(s) {failed} of the group failed to read their share; this rank stops too"
            )

    def _broadcast(self, buffer: torch.Tensor, piece: Piece) -> None:
        started = time.perf_counter()
        source = dist.get_global_rank(self._group, piece.reader)
        self._wait(dist.broadcast(buffer, src=source, group=self._group, async_op=True), "exchanging a piece")
        self.exchange_seconds += time.perf_counter() - started
        if piece.reader != self._rank:
            self.received_bytes += piece.nbytes

    def _check_same_plan(self) -> None:
        """Ranks that planned different exchanges would mix up bytes: every rank compares fingerprints."""
        mine = torch.tensor([self._plan.digest()], dtype=torch.int64, device=self._wire)
        every = [torch.zeros_like(mine) for _ in range(self._plan.world_size)]
        self._wait(dist.all_gather(every, mine, group=self._group, async_op=True), "comparing plans")
        if len({int(digest.item()) for digest in every}) != 1:
            raise ConfigError(
                "the ranks of the group asked for different tensors or opened different checkpoints: "
                "every rank must ask for the same tensors of the same checkpoint"
            )

    def _wait(self, work: dist.Work | None, doing: str) -> None:
        assert work is not None
        try:
            work.wait(timeout=self._timeout)
        except Exception as error:  # gloo and NCCL raise RuntimeError subclasses of their own
            raise StreamerError(
                f"group exchange failed while {doing} (rank {self._rank}; a rank failed, died or did not "
                f"make the same call within group_timeout={self._timeout.total_seconds():g}s): {error}"
            ) from error


def _piece_name(index: int) -> str:
    return f"<group piece {index}>"


def _piece_ref(index: int, piece: Piece) -> TensorRef:
    """A piece as a tensor of bytes, so an ordinary run reads it."""
    entry = TensorEntry(_piece_name(index), DTYPES["U8"], (piece.nbytes,), piece.begin, piece.end)
    return TensorRef(piece.file, entry)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1).view(torch.uint8)


_PIECE_MAX = 64 << 20  # pieces large enough that a collective costs little per byte
_PIECE_MIN = 128 << 10


def piece_bytes(config: StreamerConfig, refs: Sequence[TensorRef], world_size: int) -> int:
    """About eight pieces per rank (shares balanced within a sixteenth), at most a quarter of an
    explicit memory limit."""
    total = sum(ref.entry.nbytes for ref in refs)
    size = min(_PIECE_MAX, max(_PIECE_MIN, -(-total // (8 * world_size))))
    limit = config.explicit_memory_limit
    return size if limit is None else max(DIRECT_IO_ALIGNMENT, min(size, limit // 4))


def group_exchange(
    checkpoint: Checkpoint,
    storage: Storage,
    refs: Sequence[TensorRef],
    group: dist.ProcessGroup,
    config: StreamerConfig,
    destination: Destination,
    *,
    ordered: bool,
) -> GroupExchange:
    """This rank's part in loading ``refs`` with ``group``: its share is read into CPU buffers
    under ``config``'s memory limit."""
    world = dist.get_world_size(group)
    if world < 1 or dist.get_rank(group) < 0:
        raise ConfigError("this process is not a member of the group it was given")
    plan = make_plan(refs, world, piece_bytes(config, refs, world))
    cpu = functools.partial(CpuSink, config, one_receiver=storage.one_receiver)

    def run_for(pieces: Sequence[TensorRef]) -> Run:
        return Run(checkpoint, pieces, config, cpu, ordered=True, storage=storage)

    return GroupExchange(
        plan, refs, group, run_for, destination, timeout=config.group_timeout, ordered=ordered
    )

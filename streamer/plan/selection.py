"""What one run reads: the selected tensors in file and offset order, and their files.

The run driver and every sink number files the same way the engine does: by position among
the files the run touches; and tensors by their position in ``refs``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from typing import NamedTuple, TypeVar

from streamer.engine.blocks import Unit
from streamer.observe.metrics import LoadMetrics
from streamer.plan.checkpoint import TensorRef

T = TypeVar("T")


class Selection(NamedTuple):
    refs: tuple[TensorRef, ...]  # sorted by file, offset, name
    files: tuple[int, ...]  # checkpoint file indices; position = engine file index

    @classmethod
    def of(cls, refs: Sequence[TensorRef]) -> Selection:
        ordered = tuple(sorted(refs, key=lambda r: (r.file, r.entry.begin, r.entry.name)))
        return cls(ordered, tuple(sorted({r.file for r in ordered})))

    def engine_file(self) -> dict[int, int]:
        return {file: i for i, file in enumerate(self.files)}

    def with_bytes(self) -> list[TensorRef]:
        """The tensors that need reading (zero-size tensors need none)."""
        return [r for r in self.refs if r.entry.nbytes > 0]

    def units(self) -> list[Unit]:
        """The bytes of each tensor that needs reading, in engine file numbering."""
        engine_file = self.engine_file()
        return [Unit(engine_file[r.file], r.entry.begin, r.entry.end) for r in self.with_bytes()]

    def positions(self) -> list[int]:
        """Where each tensor that needs reading stands in ``refs``."""
        return [i for i, r in enumerate(self.refs) if r.entry.nbytes > 0]

    def new_metrics(self) -> LoadMetrics:
        return LoadMetrics(
            files=len(self.files), tensors=len(self.refs), bytes=sum(r.entry.nbytes for r in self.refs)
        )


def run_then_close(body: Iterator[T], close: Callable[[], None]) -> Generator[T, None, None]:
    """Yields from ``body`` and always calls ``close``: at the end, on error, or when abandoned."""
    try:
        yield from body
    finally:
        close()

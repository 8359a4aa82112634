"""What one run reads: the selected tensors in file and offset order, and their files.

Both run kinds (``pipeline.LoadRun`` into CPU buffers, ``staging.StagedRun`` through a ring)
number files the same way the engine does: by position among the files the run touches.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from streamer.checkpoint import TensorRef
from streamer.metrics import LoadMetrics

T = TypeVar("T")


@dataclass(frozen=True)
class Selection:
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

"""The region sink: a group rank's share read straight into its host's shared copy of the
checkpoint (``group/shared.py``), where every rank of the host takes its tensors from, so no byte
is copied on its way to any of them.

The copy is a sparse tmpfs file. A thread of the sink's own reserves the pages of each segment
(allocating and zeroing them is most of what they cost) ahead of the reads, which are queued as
their pages are ready; nothing is charged to a budget, since the copy is the destination.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from streamer.backends.base import Delivery, FileRead
from streamer.config import StreamerConfig
from streamer.destinations.buffers import empty_tensor
from streamer.engine import native
from streamer.errors import StreamerError
from streamer.group.shared import SharedRegion
from streamer.observe.metrics import LoadMetrics
from streamer.plan.selection import Selection
from streamer.run.driver import Submit, Tally, buffer_segments

SEGMENT_BYTES = 128 << 20  # what is reserved at a time: reads start after the first one


class RegionSink(Tally):
    """Reads a selection into ``region``; unit ``i`` is the ``i``-th tensor that has bytes."""

    def __init__(
        self,
        region: SharedRegion,
        config: StreamerConfig,
        selection: Selection,
        metrics: LoadMetrics,
        *,
        request_bytes: int,
        delivery: Delivery,
    ) -> None:
        super().__init__()
        self._region: SharedRegion | None = region
        self._refs = selection.refs
        self._files = selection.files  # engine file -> checkpoint file
        self._units = selection.units()
        self._position = selection.positions()
        self._segments = buffer_segments(self._units, config, SEGMENT_BYTES, request_bytes, delivery)
        self._reserver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamer-reserve")
        self._reserved: list[Future[None]] = [
            self._reserver.submit(region.reserve, self._files[s.file], s.buffer_begin, s.buffer_end)
            for s in self._segments
        ]
        self._next_segment = 0
        self.metrics = metrics
        metrics.memory_limit_source = "group: the host's shared copy of the checkpoint"

    def open_page_fill(self, file_reads: Sequence[FileRead]) -> native.PageFill | None:
        return None  # the host's shared region: not memory of this process alone

    def plan(self) -> list[native.Unit]:
        return self._units

    def submit_what_fits(self, submit: Submit) -> bool:
        """Queues the segments whose pages are reserved, in order; False while the next is not."""
        region = self._region
        while region is not None and self._next_segment < len(self._segments):
            reserved = self._reserved[self._next_segment]
            if not reserved.done():
                return False
            segment = self._segments[self._next_segment]
            try:
                reserved.result()
            except OSError as error:
                raise StreamerError(
                    f"the shared copy of the checkpoint in {region.directory} cannot grow by "
                    f"{segment.size} bytes ({error.strerror}): free room there, or set "
                    "STREAMER_GROUP_SHM_DIR=none",
                    path=region.directory,
                ) from error
            self._next_segment += 1
            self.queued(segment.unit_count)
            submit(segment.blocks, region.shared_address(self._files[segment.file], segment.buffer_begin))
        return True

    @property
    def busy(self) -> bool:
        return self._next_segment < len(self._segments)

    def on_read(self, units: Sequence[int]) -> None:
        self.read(len(units))
        for unit in units:
            self.whole(self._position[unit])

    def settle(self) -> None:
        """Nothing is being read: waits for the next segment's pages."""
        if self._next_segment < len(self._segments):
            wait([self._reserved[self._next_segment]])

    def tensor(self, position: int) -> torch.Tensor:
        ref = self._refs[position]
        if ref.entry.nbytes == 0:
            return empty_tensor(ref.entry)
        assert self._region is not None, "a closed sink hands out no tensor"
        return self._region.shared_view(ref.file, ref.entry.begin, ref.entry.end)

    @property
    def peak_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Stops reserving and lets go of the region: its memory goes with the last view of it."""
        self._reserver.shutdown(wait=True, cancel_futures=True)
        self._region = None

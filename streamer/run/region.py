"""The region sink: a group rank's share read straight into its host's shared copy of the
checkpoint (``group/shared.py``), where every rank of the host takes its tensors from, so no byte
is copied on its way to any of them.

The region is memory already reserved for the whole load, so every read is queued at once and
nothing is charged to a budget; a tensor (a piece of the share) is a view of the region.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamer.config import DIRECT_IO_ALIGNMENT, StreamerConfig
from streamer.destinations.cpu import Prefaulter, empty_tensor
from streamer.engine import native
from streamer.group.shared import SharedRegion
from streamer.metrics import LoadMetrics
from streamer.planner import plan_segments
from streamer.run.driver import Submit
from streamer.selection import Selection


class RegionSink:
    """Reads a selection into ``region``; unit ``i`` is the ``i``-th tensor that has bytes."""

    def __init__(
        self,
        region: SharedRegion,
        config: StreamerConfig,
        selection: Selection,
        metrics: LoadMetrics,
        *,
        one_receiver: bool,
        request_bytes: int,
        file_grid: bool,
    ) -> None:
        self._region: SharedRegion | None = region
        # As for CPU buffers: where one thread receives every byte, pages are mapped in elsewhere.
        self._prefaulter = Prefaulter() if one_receiver and selection.files else None
        self._refs = selection.refs
        self._files = selection.files  # engine file -> checkpoint file
        self._units = selection.units()
        self._position = selection.positions()
        self._segments = plan_segments(
            self._units,
            block_size=config.block_size,
            segment_bytes=None,
            alignment=DIRECT_IO_ALIGNMENT,
            request_bytes=request_bytes,
            file_grid=file_grid,
        )
        self._submitted = False
        self._in_flight = 0
        self._completed: list[int] = []
        self.metrics = metrics
        metrics.memory_limit_source = "group: the host's shared copy of the checkpoint"

    def plan(self) -> list[native.Unit]:
        return self._units

    def submit_what_fits(self, submit: Submit) -> bool:
        region = self._region
        if not self._submitted and region is not None:
            self._submitted = True
            for segment in self._segments:
                self._in_flight += segment.last_unit - segment.first_unit + 1
                address = region.shared_address(self._files[segment.file], segment.buffer_begin)
                if self._prefaulter is not None:
                    self._prefaulter.submit(address, segment.size)
                submit(segment.blocks, address)
        return True

    @property
    def reading(self) -> bool:
        return self._in_flight > 0

    @property
    def busy(self) -> bool:
        return False

    def on_read(self, units: Sequence[int]) -> None:
        self._in_flight -= len(units)
        self._completed.extend(self._position[unit] for unit in units)

    def settle(self) -> None:
        """Nothing of the sink's own to wait for."""

    def completed(self) -> list[int]:
        completed, self._completed = self._completed, []
        return completed

    def tensor(self, position: int) -> torch.Tensor:
        ref = self._refs[position]
        if ref.entry.nbytes == 0:
            return empty_tensor(ref.entry)
        assert self._region is not None, "a closed sink hands out no tensor"
        return self._region.view(ref.file, ref.entry.begin, ref.entry.end)

    @property
    def peak_bytes(self) -> int:
        return 0

    def close(self) -> None:
        """Stops prefaulting and lets go of the region: its memory goes with the last view of it."""
        self._region = None
        prefaulter, self._prefaulter = self._prefaulter, None
        if prefaulter is not None:
            prefaulter.close()
            self.metrics.prefault_bytes = prefaulter.submitted

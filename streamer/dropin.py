"""``safe_open`` as ``safetensors`` has it, on streamer's readers: switching is an import change.

``from safetensors import safe_open`` becomes ``from streamer import safe_open``. Tensors are read
by a ``Streamer`` handle, so local files and ``s3://`` objects take the same path and its
``metrics`` count every byte. ``get_slice(name)[index]`` reads only the bytes the index needs
(see ``streamer.plan.slicing``): a rank of a tensor-parallel group reads its shard of a weight, e.g.
``[rank * k:(rank + 1) * k]`` (one contiguous read, returned as a view of it) or
``[:, rank * k:(rank + 1) * k]`` (the rows that cover it where the gaps between its runs cost less
to read than another request, strided ranges where they cost more: see ``ReadCost``).
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

import torch

from streamer.api import check_backend
from streamer.backends.sources import SourceArg
from streamer.config import StreamerConfig
from streamer.destinations.buffers import MemoryBudget, allocate_buffer
from streamer.errors import ConfigError, FileClosedError, MissingTensorError, PackedSliceError
from streamer.format.safetensors import TensorEntry
from streamer.handle import Streamer
from streamer.plan.checkpoint import TensorRef
from streamer.plan.readahead import KeyWalk

if TYPE_CHECKING:
    from streamer.plan import slicing

FRAMEWORKS = ("pt", "torch")


class safe_open:  # safetensors' name (a class there too), so that only the import changes
    """A checkpoint opened lazily, as ``safetensors.safe_open``: a context manager, or call ``close()``.

    ``filename`` may also be anything ``streamer.open`` takes (a directory, a list of files, an
    index, ``s3://``). ``framework`` must be ``"pt"`` (or ``"torch"``); ``device`` a str, an int
    (``cuda:N``) or a ``torch.device``; ``backend`` is checked as safetensors checks it, then
    ignored. ``config`` is streamer's own.
    """

    def __init__(
        self,
        filename: SourceArg,
        framework: str = "pt",
        device: str | int | torch.device = "cpu",
        *,
        backend: str = "mmap",
        config: StreamerConfig | None = None,
    ) -> None:
        if framework not in FRAMEWORKS:
            raise ConfigError(
                f"framework {framework!r} is not supported: streamer returns torch tensors "
                "(framework='pt'); use safetensors for numpy, tensorflow, flax or mlx"
            )
        check_backend(backend)
        self._handle = Streamer(filename, device=device, config=config, order="checkpoint")
        self._walk: KeyWalk | None = None  # get_tensor's read-ahead, over keys() in sorted order
        self._closed = False

    @property
    def handle(self) -> Streamer:
        """The ``Streamer`` underneath (``metrics`` of the last read); ``FileClosedError`` once closed."""
        if self._closed:
            raise FileClosedError("file is closed", path=self._where)
        return self._handle

    @property
    def _where(self) -> str:
        return ", ".join(self._handle.files)

    def keys(self) -> list[str]:
        """Tensor names, sorted (as safetensors sorts them)."""
        return sorted(self.handle.keys())

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their bytes (file by file)."""
        return self.handle.keys()

    def metadata(self) -> dict[str, str] | None:
        """``__metadata__`` (merged over the files); None when no file has one."""
        handle = self.handle
        return handle.metadata() if any(h.has_metadata for h in handle.checkpoint.headers) else None

    def get_tensor(self, name: str) -> torch.Tensor:
        """One tensor; called for the keys in ``keys()`` order, it reads the ones that follow
        ahead, in windows (``streamer.plan.readahead``)."""
        ref = self._ref(name)
        if self._walk is None:
            self._walk = self.handle.key_walk(self.keys())
        return self._walk.get(ref.entry.name)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, in one run (as fast as ``streamer.load``), keyed in ``keys()`` order."""
        names = self.keys()
        return dict(zip(names, self.handle.read([self._ref(name) for name in names]), strict=True))

    def get_slice(self, name: str) -> TensorSlice:
        """A lazy view of one tensor: index it to read part of it (it stays usable after ``close``)."""
        return TensorSlice(self, self._ref(name))

    def _ref(self, name: str) -> TensorRef:
        tensors = self.handle.checkpoint.tensors
        if name not in tensors:
            raise MissingTensorError("no tensor of that name", path=self._where, tensor=name)
        return tensors[name]

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return repr(self._handle).replace("<streamer.Streamer ", "<streamer.safe_open ", 1)

    def close(self) -> None:
        """Releases files and connections; slices taken before stay usable (each read of one
        reopens what it needs and releases it again)."""
        self._closed = True
        if self._walk is not None:
            self._walk.clear()
        self._handle.close()

    def __enter__(self) -> safe_open:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class TensorSlice:
    """One tensor, read only as far as an index needs: ``get_slice(name)[index]``.

    Indexing follows torch (so safetensors): ints (negative from the end), slices with a positive
    step, ``...`` and ``None`` read only the bytes they select; any other index (lists, tensors,
    masks) reads the whole tensor and indexes it. Packed dtypes (``F4``) are indexed in values,
    as ``get_shape`` counts them, and must keep whole bytes (``PackedSliceError``).
    """

    def __init__(self, owner: safe_open, ref: TensorRef) -> None:
        self._handle = owner._handle
        self._ref = ref
        entry = ref.entry
        per_item = entry.dtype.per_item
        self._shape = (*entry.shape[:-1], entry.shape[-1] * per_item) if per_item > 1 else entry.shape

    @property
    def _entry(self) -> TensorEntry:
        return self._ref.entry

    def __repr__(self) -> str:
        path = self._handle.checkpoint.headers[self._ref.file].path
        return (
            f"<streamer.TensorSlice {self._entry.name!r} {self.get_dtype()} {self.get_shape()} of {path!r}>"
        )

    def get_shape(self) -> list[int]:
        """The shape in the header (a packed dtype counts values, not torch elements)."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The safetensors dtype name, e.g. ``"BF16"``."""
        return self._entry.dtype.name

    def __getitem__(self, index: object) -> torch.Tensor:
        from streamer.plan import slicing  # imported by the first slice: ~2 ms of every import spared

        entry = self._entry
        path = self._handle.checkpoint.headers[self._ref.file].path
        if not slicing.is_basic(index):
            if entry.dtype.per_item > 1:
                raise PackedSliceError(
                    "only ints, slices, ... and None index a packed dtype", path=path, tensor=entry.name
                )
            return self._read([self._ref])[0][index]  # type: ignore[index]
        layout = slicing.pack(
            slicing.select(index, self._shape), entry.dtype.per_item, name=entry.name, path=path
        )
        dtype = entry.dtype.torch_dtype
        if layout.numel == 0:
            return torch.empty(layout.shape, dtype=dtype, device=self._handle.device)
        itemsize = entry.dtype.itemsize
        cost = self._handle.read_cost_of(self._ref)
        plan = slicing.plan(layout, base=entry.begin, itemsize=itemsize, request_bytes=cost.request_bytes)
        packing = slicing.packing(plan, alignment=cost.alignment, block_size=self._handle.config.block_size)
        packed = self._read_packed(packing)
        if len(plan.range_table) == 1:
            selected = _from_range(
                plan, packing, packed, layout, entry, hugepages=self._handle.config.hugepages
            )
        else:
            gathered = _gather(plan, packing, packed, hugepages=self._handle.config.hugepages)
            selected = gathered.view(dtype).view(layout.shape)
        return selected.to(self._handle.device)

    def _read(self, refs: list[TensorRef]) -> list[torch.Tensor]:
        """One run; once the ``safe_open`` is closed, what the run reopened (an S3 client) is closed again."""
        with self._handle.reopened():
            return self._handle.read(refs)

    def _read_packed(self, packing: slicing.Packing) -> torch.Tensor:
        """``_read`` of the ranges ``packing`` lays out, into one CPU buffer."""
        with self._handle.reopened():
            return self._handle.read_packed(self._ref, packing)


def _from_range(
    plan: slicing.ReadPlan,
    packing: slicing.Packing,
    packed: torch.Tensor,
    layout: slicing.StridedView,
    entry: TensorEntry,
    *,
    hugepages: bool,
) -> torch.Tensor:
    """The selection out of the one range read: a view of the range where the selection is all of
    it, else a copy (a shard must not keep the covering bytes alive)."""
    begin, end = (int(x) for x in plan.range_table[0])
    start = int(packing.run_offsets[0]) - (int(plan.run_begins[0]) - begin)  # the range in the buffer
    flat = packed[start : start + end - begin]
    itemsize = entry.dtype.itemsize
    if flat.data_ptr() % itemsize:
        flat = flat.clone()  # a file that does not align its tensors (safetensors' files do)
    flat = flat.view(_BITS[itemsize])  # torch copies every integer dtype, not every float8
    first = (entry.begin - begin) // itemsize + layout.offset
    view = flat.as_strided(layout.shape, layout.stride, flat.storage_offset() + first)
    dtype = entry.dtype.torch_dtype
    if view.numel() == flat.numel():
        return flat.view(layout.shape).view(dtype)
    out, _ = allocate_buffer(view.numel() * itemsize, hugepages=hugepages, budget=MemoryBudget(None))
    return out.view(view.dtype).view(view.shape).copy_(view).view(dtype)


def _gather(
    plan: slicing.ReadPlan, packing: slicing.Packing, packed: torch.Tensor, *, hugepages: bool
) -> torch.Tensor:
    """The runs of ``plan``, in order, out of the packed buffer, as one flat uint8 tensor.

    Runs evenly spaced in the buffer (every 2-d shard) are one strided copy, or none where they
    lie back to back; others one indexed copy. The copy lands in memory of the loader's own
    (huge pages where on), not torch's: first touch of fresh memory costs more than the copy.
    """
    offsets, length = packing.run_offsets, plan.run_bytes
    count = len(offsets)
    steps = offsets[1:] - offsets[:-1]
    first = int(offsets[0])
    if (steps == steps[0]).all() and int(steps[0]) == length:
        return packed[first : first + count * length]
    out, _ = allocate_buffer(count * length, hugepages=hugepages, budget=MemoryBudget(None))
    rows = out.view(count, length)
    if (steps == steps[0]).all():
        rows.copy_(packed.as_strided((count, length), (int(steps[0]), 1), first))
    else:
        torch.index_select(packed.unfold(0, length, 1), 0, torch.from_numpy(offsets), out=rows)
    return out


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

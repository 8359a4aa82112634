"""``safe_open`` as ``safetensors`` has it, on streamer's readers: switching is an import change.

``from safetensors import safe_open`` becomes ``from streamer import safe_open``. Tensors are read
by a ``Streamer`` handle, so local files and ``s3://`` objects take the same path and its
``metrics`` count every byte. ``get_slice(name)[index]`` reads only the bytes the index needs
(see ``streamer.slicing``): a rank of a tensor-parallel group reads its shard of a weight, e.g.
``[rank * k:(rank + 1) * k]`` (one contiguous read, returned as a view of it) or
``[:, rank * k:(rank + 1) * k]`` (the rows that cover it where the gaps between its runs cost less
to read than another request, strided ranges where they cost more: see ``ReadCost``).
"""

from __future__ import annotations

from types import TracebackType

import torch

from streamer import slicing
from streamer.api import Streamer, check_backend
from streamer.checkpoint import TensorRef
from streamer.config import StreamerConfig
from streamer.errors import ConfigError, FileClosedError, MissingTensorError, PackedSliceError
from streamer.format.dtypes import DTYPES
from streamer.format.safetensors import TensorEntry
from streamer.sources import SourceLike

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
        filename: SourceLike,
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
        return self.handle.read([self._ref(name)])[0]

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

    def close(self) -> None:
        """Releases files and connections; slices taken before stay usable (each read of one
        reopens what it needs and releases it again)."""
        self._closed = True
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
        self._owner = owner
        self._handle = owner._handle
        self._ref = ref
        entry = ref.entry
        per_item = entry.dtype.per_item
        self._shape = (*entry.shape[:-1], entry.shape[-1] * per_item) if per_item > 1 else entry.shape

    @property
    def _entry(self) -> TensorEntry:
        return self._ref.entry

    def get_shape(self) -> list[int]:
        """The shape in the header (a packed dtype counts values, not torch elements)."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The safetensors dtype name, e.g. ``"BF16"``."""
        return self._entry.dtype.name

    def __getitem__(self, index: object) -> torch.Tensor:
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
        plan = slicing.plan(
            layout,
            base=entry.begin,
            itemsize=itemsize,
            request_bytes=self._handle.read_cost.request_bytes,
        )
        pieces = self._read([self._piece(b, e) for b, e in plan.ranges])
        if len(pieces) == 1:
            (flat,) = pieces
            if flat.data_ptr() % itemsize:
                flat = flat.clone()  # a file that does not align its tensors (safetensors' files do)
            flat = flat.view(_BITS[itemsize])  # torch copies every integer dtype, not every float8
            first = (entry.begin - plan.ranges[0][0]) // itemsize + layout.offset
            view = flat.as_strided(layout.shape, layout.stride, flat.storage_offset() + first)
            if view.numel() == flat.numel():
                return flat.view(layout.shape).view(dtype)  # the selection is the range read: no copy
            # A copy lets the covering bytes go (a shard must not pin the whole weight).
            return view.clone(memory_format=torch.contiguous_format).view(dtype)
        return _gather(plan, pieces).view(dtype).view(layout.shape)

    def _read(self, refs: list[TensorRef]) -> list[torch.Tensor]:
        """One run; once the ``safe_open`` is closed, what the run reopened (an S3 client) is closed again."""
        try:
            return self._handle.read(refs)
        finally:
            if self._owner.closed:
                self._handle.close()

    def _piece(self, begin: int, end: int) -> TensorRef:
        """Bytes ``[begin, end)`` of this tensor as a 1-d uint8 tensor, named for errors."""
        entry = self._entry
        name = f"{entry.name}[bytes {begin - entry.begin}:{end - entry.begin}]"
        return TensorRef(self._ref.file, TensorEntry(name, _BYTES, (end - begin,), begin, end))


def _gather(plan: slicing.ReadPlan, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The runs of ``plan``, in order, out of the ranges read (``pieces``, uint8), as one flat tensor.

    A range holding evenly spaced runs (every range of a 2-d slice) is one strided view, so
    thousands of runs cost a few tensor calls, not a Python loop over them.
    """
    if len(pieces) == len(plan.run_begins):
        return torch.cat(pieces)  # each range is one run
    begins = plan.run_begins
    ranges = torch.tensor(plan.ranges, dtype=torch.int64)
    first = torch.searchsorted(begins, ranges[:, 0].contiguous()).tolist()
    length = plan.run_bytes
    parts = []
    for (begin, _), flat, lo, hi in zip(plan.ranges, pieces, first, [*first[1:], len(begins)], strict=True):
        inside = begins[lo:hi] - begin
        steps = inside[1:] - inside[:-1]
        if len(steps) == 0 or bool((steps == steps[0]).all()):
            step = int(steps[0]) if len(steps) else 0
            offset = flat.storage_offset() + int(inside[0])
            parts.append(flat.as_strided((hi - lo, length), (step, 1), offset).reshape(-1))
        else:
            parts.extend(flat[b : b + length] for b in inside.tolist())
    return torch.cat(parts)


_BYTES = DTYPES["U8"]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

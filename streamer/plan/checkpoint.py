"""A checkpoint: the parsed headers of all its files, a name → tensor table and where each file is.

Pure data: the storage session that read it (and serves its runs) belongs to the handle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from typing import NamedTuple

from streamer.backends import open_storage
from streamer.backends.base import Opened, Storage, StoredFile
from streamer.backends.sources import ResolvedSource, SourceArg, SourceLike, as_source
from streamer.config import S3Config, StreamerConfig, default_config
from streamer.errors import MissingTensorError, SourceError, StreamerError
from streamer.format.safetensors import FileHeader, TensorEntry, header_end, parse_front
from streamer.records import record

KeySelection = Callable[[str], bool] | Collection[str]
"""Which tensors a handle reads: their names, or a test a name passes."""


class TensorRef(NamedTuple):
    """A tensor and the index of the file (in ``Checkpoint.headers``) that holds it."""

    file: int
    entry: TensorEntry


@record
class Checkpoint:
    headers: tuple[FileHeader, ...]
    tensors: dict[str, TensorRef]  # in checkpoint order: file order, then offset order
    files: tuple[StoredFile, ...]  # per file: where it is, as its storage saw it (size, version)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(h.path for h in self.headers)

    def metadata(self) -> dict[str, str]:
        """``__metadata__`` of every file, merged in file order (the first file wins a clash)."""
        merged: dict[str, str] = {}
        for header in self.headers:
            for key, value in header.metadata.items():
                merged.setdefault(key, value)
        return merged

    def ref(self, name: str) -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            paths = self.paths
            where = paths[0] if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more file(s)"
            raise MissingTensorError("no tensor of that name", path=where, tensor=name) from None

    def refs(self) -> Iterator[TensorRef]:
        return iter(self.tensors.values())

    def only(self, keys: KeySelection) -> Checkpoint:
        """The checkpoint as if it held only the tensors ``keys`` names (a collection of names, every
        one of which must be here, or a predicate on a name); its files and headers stay whole."""
        if callable(keys):
            wanted = {name: ref for name, ref in self.tensors.items() if keys(name)}
        else:
            for name in keys:
                self.ref(name)  # a name that is not here raises, naming it
            wanted = {name: ref for name, ref in self.tensors.items() if name in keys}
        return dataclasses.replace(self, tensors=wanted)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data: what a full read loads."""
        return sum(ref.entry.nbytes for ref in self.tensors.values())


def open_checkpoint(source: SourceArg, s3_config: S3Config | None = None) -> Checkpoint:
    """Resolves the source and parses every header through a storage session of its own, closed
    before returning; no tensor data is read."""
    source = as_source(source)
    config = default_config() if s3_config is None else StreamerConfig(s3=s3_config)
    with open_storage(source, config) as storage:
        return confirmed(storage, read_checkpoint(storage, source))


def read_checkpoint(storage: Storage, source: SourceLike) -> Checkpoint:
    """Resolves the source with ``storage`` and parses every header; no tensor data is read.

    The open may be provisional (``Storage.confirm_open``): a checkpoint that fails to parse from
    it is parsed again from the storage's answer before the error is believed."""
    opened = storage.open(source)
    try:
        return checkpoint_of(storage, opened)
    except StreamerError:
        fresh = storage.confirm_open()
        if fresh is None:
            raise
    return checkpoint_of(storage, fresh)


def checkpoint_of(storage: Storage, opened: Opened) -> Checkpoint:
    """The checkpoint ``opened`` describes (the rest of a header its front lacks read from ``storage``)."""
    return _checkpoint(opened.source, _headers(storage, opened), tuple(f.file for f in opened.fronts))


def confirmed(storage: Storage, checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint``, or the fresh one if it was read from a provisional open that did not stand."""
    fresh = storage.confirm_open()
    return checkpoint if fresh is None else checkpoint_of(storage, fresh)


def _headers(storage: Storage, opened: Opened) -> tuple[FileHeader, ...]:
    """Every file's header, whatever its storage: from its front, plus the rest of the header where
    the front was shorter (all such reads at once)."""
    wanted = [
        (index, header_end(front.data, path=front.file.path, file_size=front.file.size))
        for index, front in enumerate(opened.fronts)
    ]
    short = [(index, end) for index, end in wanted if len(opened.fronts[index].data) < end]
    rest = storage.read_ranges([(opened.fronts[i].file, len(opened.fronts[i].data), end) for i, end in short])
    data = [front.data for front in opened.fronts]
    for (index, _), more in zip(short, rest, strict=True):
        data[index] += more
    return tuple(
        parse_front(bytes_, path=front.file.path, file_size=front.file.size)
        for bytes_, front in zip(data, opened.fronts, strict=True)
    )


def _checkpoint(
    resolved: ResolvedSource, headers: tuple[FileHeader, ...], files: tuple[StoredFile, ...]
) -> Checkpoint:
    tensors: dict[str, TensorRef] = {}
    for index, header in enumerate(headers):
        for entry in header.tensors:
            previous = tensors.get(entry.name)
            if previous is not None:
                raise SourceError(
                    f"tensor also defined in {headers[previous.file].path!r}",
                    path=header.path,
                    tensor=entry.name,
                )
            tensors[entry.name] = TensorRef(index, entry)
    _check_weight_map(resolved, headers, tensors)
    return Checkpoint(headers=headers, tensors=tensors, files=files)


def _check_weight_map(
    resolved: ResolvedSource, headers: tuple[FileHeader, ...], tensors: dict[str, TensorRef]
) -> None:
    """Every tensor the index promises must be in the shard the index names."""
    for name, path in resolved.weight_map.items():
        ref = tensors.get(name)
        if ref is None or headers[ref.file].path != path:
            raise SourceError(
                f"the index places this tensor in {path!r}, which does not hold it",
                path=resolved.index_path,
                tensor=name,
            )

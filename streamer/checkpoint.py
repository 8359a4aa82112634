"""A checkpoint: the parsed headers of all its files and a name → tensor table."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from streamer.backends.s3 import ClientHolder, ObjectInfo
from streamer.config import S3Config
from streamer.errors import MissingTensorError, SourceError
from streamer.format.safetensors import FileHeader, TensorEntry, read_header
from streamer.sources import ResolvedSource, SourceLike, resolve
from streamer.sources.s3 import open_s3, split_sources


@dataclass(frozen=True)
class TensorRef:
    """A tensor and the index of the file (in ``Checkpoint.headers``) that holds it."""

    file: int
    entry: TensorEntry


@dataclass(frozen=True)
class Checkpoint:
    headers: tuple[FileHeader, ...]
    tensors: dict[str, TensorRef]  # in checkpoint order: file order, then offset order
    objects: tuple[ObjectInfo | None, ...] = ()  # per file: the S3 object it is, None for a local file
    s3: ClientHolder | None = field(default=None, compare=False)  # the client its S3 runs share

    def object_of(self, file: int) -> ObjectInfo | None:
        return self.objects[file] if self.objects else None

    def close(self) -> None:
        """Closes the S3 client (thread, loop, connections) if there is one; reading again reopens it."""
        if self.s3 is not None:
            self.s3.close()

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
            where = ", ".join(self.paths)
            raise MissingTensorError("no tensor of that name", path=where, tensor=name) from None

    def refs(self) -> Iterator[TensorRef]:
        return iter(self.tensors.values())


def open_checkpoint(source: SourceLike, s3_config: S3Config | None = None) -> Checkpoint:
    """Resolves the source and parses every header; no tensor data is read."""
    uris = split_sources(source)
    objects: tuple[ObjectInfo | None, ...] = ()
    holder: ClientHolder | None = None
    if uris is not None:
        resolved, headers, objects, holder = open_s3(uris, s3_config if s3_config is not None else S3Config())
        try:
            return _checkpoint(resolved, headers, objects, holder)
        except BaseException:
            holder.close()
            raise
    else:
        resolved = resolve(source)
        headers = tuple(read_header(path) for path in resolved.paths)
    return _checkpoint(resolved, headers, objects, holder)


def _checkpoint(
    resolved: ResolvedSource,
    headers: tuple[FileHeader, ...],
    objects: tuple[ObjectInfo | None, ...],
    holder: ClientHolder | None,
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
    return Checkpoint(headers=headers, tensors=tensors, objects=objects, s3=holder)


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

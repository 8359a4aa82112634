"""What the ranks of a group agree on before a byte moves: that each opened the same checkpoint.

A rank reads its share from its own copy and the others take those bytes as theirs, so ranks
whose files differ would each get a silent mix of both. Before the first read every rank shares,
for each file, four numbers and the group compares them with rank 0's:

- the file's header, hashed whole as parsed (every name, dtype, shape, offset, metadata entry,
  and where the data starts);
- its size;
- where it is (``FileIdentity.place``): for a local file the host's boot, device, inode and
  modification time, which prove two ranks on one host read the very same file;
- what it holds (``FileIdentity.content``): an object's ETag; for a local file a hash of sampled
  blocks (``group_verify="sampled"``) or of every byte (``"full"``: a whole read of the file on
  every rank, before the load).

Two ranks agree on a file when its header and size are the same and either its place or its
content is. What a sampled hash cannot see, a copy whose bytes differ only between the samples
(a flipped bit), only ``group_verify="full"`` catches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from streamer.backends.base import Storage
from streamer.errors import ConfigError
from streamer.format.safetensors import FileHeader
from streamer.plan.checkpoint import Checkpoint

_PER_FILE = 4  # header digest, size, place digest, content digest


def identity_values(checkpoint: Checkpoint, storage: Storage, *, full: bool) -> list[int]:
    """This rank's numbers for the checkpoint: its file count, then four per file."""
    identities = storage.identify(checkpoint.files, full=full)
    values = [len(checkpoint.headers)]
    for header, identity in zip(checkpoint.headers, identities, strict=True):
        values += [
            _digest(repr(_parsed(header))),
            header.file_size,
            _digest(identity.place) if identity.place else 0,
            _digest(identity.content),
        ]
    return values


def check_agreement(every: Sequence[Sequence[int]], paths: Sequence[str]) -> None:
    """Raises the same ``ConfigError`` on every rank when a rank's numbers (``every[rank]``, as
    ``identity_values`` made them) say it opened another checkpoint than rank 0; ``paths`` are
    this rank's files, to name them."""
    first = every[0]
    for rank, values in enumerate(every[1:], start=1):
        if values[0] != first[0]:
            raise ConfigError(
                f"the ranks of the group opened different checkpoints: rank 0 has {first[0]} file(s), "
                f"rank {rank} has {values[0]}; every rank must open the same one"
            )
        for file in range(first[0]):
            mine, theirs = _file(first, file), _file(values, file)
            why = _difference(mine, theirs)
            if why is not None:
                raise ConfigError(
                    f"the ranks of the group opened different checkpoints: file {file} ({paths[file]!r} "
                    f"here) differs between rank 0 and rank {rank} in its {why}; every rank must open "
                    "the same one"
                )


def _file(values: Sequence[int], file: int) -> Sequence[int]:
    start = 1 + _PER_FILE * file
    return values[start : start + _PER_FILE]


def _difference(mine: Sequence[int], theirs: Sequence[int]) -> str | None:
    header, size, place, content = mine
    if theirs[0] != header:
        return "header (tensor names, dtypes, shapes, offsets or metadata)"
    if theirs[1] != size:
        return "size"
    if place and theirs[2] == place:
        return None  # the very same file
    if theirs[3] != content:
        return "bytes (the object's version, or a hash of the file's content)"
    return None


def _parsed(header: FileHeader) -> tuple[object, ...]:
    """Everything the header says, in a form every rank writes alike."""
    tensors = [(t.name, t.dtype.name, t.shape, t.begin, t.end) for t in header.tensors]
    return (header.data_start, tensors, sorted(header.metadata.items()), header.has_metadata)


def _digest(text: str) -> int:
    """A 63-bit digest (an int64 a collective carries)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

"""The cache's chunk files on their own: any window of a chunk reads back exactly, straight into
the caller's memory (O_DIRECT where aligned, buffered elsewhere), and every way a chunk file can
be wrong (a flipped bit in any piece or in its head, a cut, a foreign chunk) fails the read and
removes the file, whichever part of the chunk the read wanted."""

from __future__ import annotations

import mmap
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import s3_stored, takes_direct_io

pytest.importorskip("xxhash")

from streamer.backends.base import Front, Opened
from streamer.backends.cache import store as cache_store
from streamer.backends.cache.notes import NoteOf, OpenNotes
from streamer.backends.cache.store import HEAD_BYTES, ChunkBuffer, ChunkStore, identity, piece_bytes
from streamer.backends.s3.uri import ObjectInfo, S3Uri
from streamer.backends.sources import ResolvedSource
from streamer.host.safedir import Access

IDENT = identity("http://127.0.0.1:9", "bucket", "m/a.safetensors", 99 << 20, '"etag-a"')
OTHER = identity("http://127.0.0.1:9", "bucket", "m/b.safetensors", 99 << 20, '"etag-b"')
PRIVATE = Access()
CHUNK = 1 << 20
OFFSET = 3 * CHUNK  # the chunk's place in its object
PIECE = piece_bytes(CHUNK)


def chunk_data(length: int = CHUNK - 5) -> bytes:
    return random.Random(length).randbytes(length)


def stored(tmp_path: Path, data: bytes, *, direct: bool = True) -> tuple[ChunkStore, Path]:
    """A store holding ``data`` as chunk 3, written and read with O_DIRECT or buffered."""
    store = ChunkStore(str(tmp_path), 1 << 30, PRIVATE)
    store._direct = direct
    chunk = ChunkBuffer(len(data))  # page-aligned: the aligned part is written with O_DIRECT
    with chunk.data as view:
        view[:] = data
        assert store.write(IDENT, 3, OFFSET, view, PIECE)
    return store, tmp_path / "v3" / IDENT / "3.chunk"


def windows(length: int) -> list[tuple[int, int]]:
    """Whole, aligned, piece-straddling, one-byte and tail windows of a chunk of ``length``."""
    edges = [0, 1, 4095, 4096, PIECE - 1, PIECE, PIECE + 4096, 3 * PIECE + 7, length - 4097, length - 1]
    found = {(0, length), (PIECE, 3 * PIECE), (5, length), (0, length - 3), (length - 1, length)}
    found |= {(a, b) for a in edges for b in edges if a < b <= length}
    return sorted(found)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_every_window_reads_back_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    data = chunk_data()
    store, path = stored(tmp_path, data, direct=direct)
    assert path.stat().st_size == HEAD_BYTES + len(data)  # the write's alignment padding cut off
    direct_bytes = 0
    read_direct = ChunkStore._read_direct

    def counted(self: ChunkStore, fd: int, out: memoryview, position: int) -> int:
        nonlocal direct_bytes
        done = read_direct(self, fd, out, position)
        direct_bytes += done
        return done

    monkeypatch.setattr(ChunkStore, "_read_direct", counted)
    memory = mmap.mmap(-1, CHUNK + 8192)  # page-aligned, as the run's buffers are
    for shift in (0, 4096, 1):  # aligned, aligned elsewhere, unaligned memory
        for low, high in windows(len(data)):
            out = memoryview(memory)[shift + low : shift + high]
            out[:] = b"\xee" * (high - low)
            assert store.read_into(IDENT, 3, OFFSET, len(data), OFFSET + low, out), (shift, low, high)
            assert out == data[low:high], (shift, low, high)
            out.release()
    memory.close()
    assert (direct_bytes > 0) == (direct and takes_direct_io(tmp_path))
    assert store.errors == 0


def buffer(size: int, aligned: bool) -> memoryview:
    """Memory for a read: page-aligned (a whole chunk then goes through one O_DIRECT read) or not."""
    if aligned:
        return memoryview(mmap.mmap(-1, size))
    return memoryview(bytearray(size + 1))[1:]


def corruptions(length: int) -> list[tuple[str, int]]:
    """(what, byte of the file to flip)."""
    return [
        ("magic", 0),
        ("identity", 8),
        ("identity's last byte", 39),
        ("offset", 40),
        ("length", 48),
        ("piece size", 56),
        ("head checksum", 64),
        ("first piece checksum", 72),
        ("last piece checksum", 72 + 8 * (-(-length // PIECE) - 1)),
        ("first byte", HEAD_BYTES),
        ("middle piece", HEAD_BYTES + length // 2),
        ("last byte", HEAD_BYTES + length - 1),
    ]


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("what,position", corruptions(CHUNK - 5))
def test_a_flipped_bit_fails_every_read_that_touches_it(
    tmp_path: Path, what: str, position: int, aligned: bool
) -> None:
    data = chunk_data()
    for number, (low, high) in enumerate(
        [(0, len(data)), (position - HEAD_BYTES - 1, position - HEAD_BYTES + 2)]
    ):
        if low < 0:
            continue  # a head byte: the whole-chunk read covers it
        store, path = stored(tmp_path / str(number), data)
        raw = bytearray(path.read_bytes())
        raw[position] ^= 0x10
        path.write_bytes(bytes(raw))
        out = buffer(high - low, aligned)
        assert not store.read_into(IDENT, 3, OFFSET, len(data), OFFSET + low, out), what
        assert store.errors == 1 and not path.exists()


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("length", [CHUNK - 5, CHUNK])
def test_cut_grown_foreign_and_missing_chunks_are_misses(tmp_path: Path, length: int, aligned: bool) -> None:
    data = chunk_data(length)
    out = buffer(len(data), aligned)
    store, path = stored(tmp_path, data)
    assert not store.read_into(IDENT, 3, OFFSET + CHUNK, len(data), OFFSET + CHUNK, out)  # another place
    assert store.errors == 1 and not path.exists()
    for size in (HEAD_BYTES + len(data) - 100, HEAD_BYTES + len(data) + 1, HEAD_BYTES + len(data) + 4096):
        store, path = stored(tmp_path, data)
        os.truncate(path, size)  # cut, or grown by junk after the data
        assert not store.read_into(IDENT, 3, OFFSET, len(data), OFFSET, out), size
        assert store.errors == 1
        assert not store.read_into(IDENT, 3, OFFSET, len(data), OFFSET, out)  # gone: a miss, not an error
        assert store.errors == 1


def test_the_head_padding_is_not_data(tmp_path: Path) -> None:
    """Bytes between the piece table and the data belong to nothing: a chunk still reads."""
    data = chunk_data()
    store, path = stored(tmp_path, data)
    raw = bytearray(path.read_bytes())
    raw[HEAD_BYTES - 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    out = memoryview(bytearray(len(data)))
    assert store.read_into(IDENT, 3, OFFSET, len(data), OFFSET, out) and out == data


def test_pieces_fit_the_head_for_any_chunk_size() -> None:
    for chunk in (4096, 64 << 10, 1 << 20, 8 << 20, 64 << 20, 1 << 30):
        piece = piece_bytes(chunk)
        assert piece % 4096 == 0 and -(-chunk // piece) <= 128
    assert cache_store._MAX_PIECES >= 128


def test_a_chunk_written_from_unaligned_memory_reads_back(tmp_path: Path) -> None:
    """The run's memory need not be aligned: what O_DIRECT cannot take is written buffered."""
    data = chunk_data()
    store = ChunkStore(str(tmp_path), 1 << 30, PRIVATE)
    memory = bytearray(len(data) + 1)
    with memoryview(memory)[1:] as unaligned:
        unaligned[:] = data
        assert store.write(IDENT, 3, OFFSET, unaligned, PIECE)
    out = memoryview(bytearray(len(data)))
    assert store.read_into(IDENT, 3, OFFSET, len(data), OFFSET, out) and out == data


def test_writers_at_once_never_leave_the_directory_over_max_bytes(tmp_path: Path) -> None:
    """Eight threads write 160 small chunks into a store bounded at four: however their renames
    and evictions interleave, what is left on disk holds at most ``max_bytes``."""
    data = memoryview(chunk_data(64 << 10))
    limit = 4 * (HEAD_BYTES + len(data))
    store = ChunkStore(str(tmp_path), limit, PRIVATE)

    def write(number: int) -> None:
        assert store.write(
            identity(None, "b", f"k{number % 3}", 1, None), number, number * len(data), data, PIECE
        )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(write, range(160)))
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("v3/*/*.chunk"))
    assert 0 < on_disk <= limit


# --- notes of how a source resolved (``notes.py``) ---------------------------------------------


def _front(key: str, header: bytes, size: int, etag: str | None) -> Front:
    data = len(header).to_bytes(8, "little") + header
    return Front(ObjectInfo(S3Uri("bucket", key), size, etag), data + b"tensor bytes past the header")


def test_a_note_reads_back_as_the_open_it_noted_with_each_header_whole(tmp_path: Path) -> None:
    first = '{"é": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'.encode()
    second = b'{"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}  '
    fronts = (_front("m/a.safetensors", first, 99, '"e1"'), _front("m/b.safetensors", second, 80, None))
    source = ResolvedSource(
        paths=tuple(f.file.path for f in fronts),
        weight_map={"é": "s3://bucket/m/a.safetensors", "x": "s3://bucket/m/b.safetensors"},
        index_path="s3://bucket/m/model.safetensors.index.json",
    )
    notes = OpenNotes(str(tmp_path), PRIVATE, s3_stored)
    of = NoteOf("http://127.0.0.1:9", ("s3://bucket/m/model.safetensors.index.json",))
    assert notes.read(of) is None
    (tmp_path / "opens").mkdir()
    (tmp_path / "opens" / f"{of.key}.note.tmp.999999999.1").write_bytes(b"torn by kill -9")
    notes.write(of, Opened(source, fronts))
    got = notes.read(of)
    assert got is not None and got.source == source
    assert [f.file for f in got.fronts] == [f.file for f in fronts]
    for old, new in zip(fronts, got.fronts, strict=True):
        end = 8 + int.from_bytes(old.data[:8], "little")
        assert new.data == old.data[:end]  # the header, not the bytes after it
    assert NoteOf(None, ("s3://bucket/m/",)).key != NoteOf("http://127.0.0.1:9", ("s3://bucket/m/",)).key
    assert not list(tmp_path.glob("opens/*.tmp.*"))


def test_no_note_of_a_front_short_of_its_header(tmp_path: Path) -> None:
    header = b'{"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}'
    cut = len(header).to_bytes(8, "little") + header[:10]
    short = Front(ObjectInfo(S3Uri("bucket", "k"), 200, '"e"'), cut)
    notes = OpenNotes(str(tmp_path), PRIVATE, s3_stored)
    of = NoteOf(None, ("s3://bucket/k",))
    notes.write(of, Opened(ResolvedSource(paths=("s3://bucket/k",)), (short,)))
    assert notes.read(of) is None and not list(tmp_path.glob("opens/*"))

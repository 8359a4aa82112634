"""Sources as an attacker or a careless user hands them over: paths of every type, a directory
whose index is the source of truth, an index naming files outside its directory, and indexes or
headers sized to exhaust time and memory. Each ends in exactly the files asked for, or a typed
error naming the index, file or entry."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Written, assert_same_dict, random_tensor, write_checkpoint

import streamer
from streamer.backends.sources import MAX_INDEX_BYTES
from streamer.errors import ConfigError, HeaderError, MissingFileError, SourceError, SourceTypeError
from streamer.format.safetensors import MAX_TENSORS


def _tensors(count: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": random_tensor((8, 16), torch.float32, generator) for i in range(count)}


@pytest.fixture
def sharded(tmp_path: Path) -> Written:
    return write_checkpoint(tmp_path / "model", _tensors(), shards=3)


# --- paths as users pass them ------------------------------------------------------------------


class _Fspath:
    """An os.PathLike whose path is bytes (as os.DirEntry of a bytes scandir is)."""

    def __init__(self, path: bytes) -> None:
        self._path = path

    def __fspath__(self) -> bytes:
        return self._path


@pytest.mark.parametrize("kind", ["str", "bytes", "pathlib", "bytes-pathlike"])
def test_every_path_type_open_takes_loads_a_file_list_directory_and_index(
    sharded: Written, kind: str
) -> None:
    def as_kind(path: Path) -> Any:
        return {
            "str": str(path),
            "bytes": os.fsencode(path),
            "pathlib": pathlib.PurePosixPath(path),
            "bytes-pathlike": _Fspath(os.fsencode(path)),
        }[kind]

    assert sharded.index is not None
    for source in (as_kind(sharded.directory), as_kind(sharded.index), [as_kind(p) for p in sharded.shards]):
        assert_same_dict(streamer.load(source), sharded.tensors)
        with streamer.safe_open(source, "pt") as handle:
            assert sorted(handle.keys()) == sorted(sharded.tensors)
    assert_same_dict(streamer.load_file(as_kind(sharded.shards[0])), streamer.load(str(sharded.shards[0])))
    dest = {name: torch.empty_like(t) for name, t in sharded.tensors.items()}
    streamer.load_into(dest, as_kind(sharded.directory))
    assert_same_dict(dest, sharded.tensors)


@pytest.mark.parametrize("source", [5, None, 3.5, {"a": 1}, [b"ok", 7], object()])
def test_a_source_of_another_type_is_a_typed_error_saying_what_was_passed(source: Any) -> None:
    with pytest.raises(SourceTypeError) as info:
        streamer.load_file(source)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    shown = type(source if not isinstance(source, list) else source[1]).__name__
    assert shown in str(info.value)
    with pytest.raises(SourceTypeError):
        streamer.safe_open(source, "pt")
    with pytest.raises(SourceTypeError):
        streamer.load_into({}, source)


def test_a_path_with_a_nul_byte_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError):
        streamer.load_file(str(tmp_path / "a\0b.safetensors"))
    with pytest.raises(SourceError):
        streamer.load_file(os.fsencode(tmp_path) + b"/a\0b.safetensors")


# --- a directory with an index: the index is the source of truth ------------------------------


def test_a_directory_with_an_index_and_a_missing_shard_names_the_index_and_the_shard(
    sharded: Written,
) -> None:
    sharded.shards[2].unlink()  # an interrupted download
    with pytest.raises(MissingFileError) as info:
        streamer.load(sharded.directory)
    assert isinstance(info.value, SourceError) and isinstance(info.value, FileNotFoundError)
    assert info.value.path == str(sharded.index)
    assert sharded.shards[2].name in str(info.value)
    assert sharded.shards[0].name not in str(info.value)


def test_a_directory_with_an_index_ignores_stray_safetensors_files(sharded: Written) -> None:
    # Mistral repos ship consolidated.safetensors beside the shards: the same tensors, once more.
    streamer_free = {name: t.clone() for name, t in sharded.tensors.items()}
    write_checkpoint(sharded.directory, streamer_free, index=False, prefix="consolidated")
    write_checkpoint(sharded.directory, {"stray": torch.ones(3)}, index=False, prefix="zzz-leftover")
    with streamer.open(sharded.directory) as handle:
        assert sorted(handle.files) == sorted(str(p) for p in sharded.shards)
        assert sorted(handle.keys()) == sorted(sharded.tensors)
    assert_same_dict(streamer.load(sharded.directory), sharded.tensors)


def test_an_index_of_another_name_is_found_and_several_without_the_default_are_ambiguous(
    tmp_path: Path,
) -> None:
    written = write_checkpoint(tmp_path / "d", _tensors(), shards=2, prefix="diffusion_pytorch_model")
    write_checkpoint(tmp_path / "d", {"stray": torch.ones(3)}, index=False, prefix="zzz")
    assert_same_dict(streamer.load(written.directory), written.tensors)
    write_checkpoint(tmp_path / "d", {"other": torch.ones(3)}, prefix="other")
    with pytest.raises(SourceError, match="several index files") as info:
        streamer.open(written.directory)
    assert info.value.path == str(written.directory)
    # model.safetensors.index.json, when present, is the one.
    model = write_checkpoint(tmp_path / "d", _tensors(4, seed=1), shards=2, prefix="model")
    assert_same_dict(streamer.load(written.directory), model.tensors)


# --- an index is data: it names files in its directory only -------------------------------------


@pytest.mark.parametrize(
    "entry",
    ["../elsewhere/x.safetensors", "/etc/passwd", "sub/../../x.safetensors", "..", ".", "", "a\0b"],
)
def test_an_index_entry_outside_its_directory_is_refused_before_any_file_opens(
    tmp_path: Path, entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = write_checkpoint(tmp_path / "elsewhere", {"x": torch.ones(4)}, index=False, prefix="x")
    written = write_checkpoint(tmp_path / "model", _tensors(2), shards=1)
    assert written.index is not None
    document = json.loads(written.index.read_text())
    document["weight_map"]["x"] = entry
    written.index.write_text(json.dumps(document))
    opened: list[str] = []
    real = streamer.backends.local.read_front
    monkeypatch.setattr(streamer.backends.local, "read_front", lambda p, n: opened.append(p) or real(p, n))
    for source in (written.index, written.directory):
        with pytest.raises(SourceError, match="outside the index's directory") as info:
            streamer.open(source)
        assert info.value.path == str(written.index)
        assert info.value.tensor == "x"
    assert opened == []
    assert outside.shards[0].exists()


def test_an_index_entry_in_a_subdirectory_and_hugging_face_symlinked_snapshots_load(tmp_path: Path) -> None:
    # The Hugging Face cache: snapshots/<rev>/<shard> are symlinks to ../../blobs/<hash>.
    tensors = _tensors(6)
    built = write_checkpoint(tmp_path / "build", tensors, shards=2)
    blobs = tmp_path / "hub" / "blobs"
    snapshot = tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    assert built.index is not None
    for number, path in enumerate([*built.shards, built.index]):
        blob = blobs / f"blob{number}"
        path.rename(blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    assert_same_dict(streamer.load(snapshot), tensors)
    assert_same_dict(streamer.load(snapshot / built.index.name), tensors)
    # An entry below the index's directory is inside it.
    nested = write_checkpoint(tmp_path / "nested" / "weights", _tensors(3), index=False, prefix="part")
    index = tmp_path / "nested" / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {name: "weights/part.safetensors" for name in nested.tensors}})
    )
    assert_same_dict(streamer.load(index), nested.tensors)
    assert_same_dict(
        streamer.load(tmp_path / "nested" / "./weights/../model.safetensors.index.json"), nested.tensors
    )


# --- resource limits on untrusted metadata ----------------------------------------------------


def test_an_index_over_the_size_limit_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    with index.open("wb") as file:
        file.write(b'{"weight_map": {"a": "')
        file.truncate(MAX_INDEX_BYTES + 10)  # sparse: no disk, but read whole it would be 100 MB
    started = time.monotonic()
    with pytest.raises(SourceError, match="larger than") as info:
        streamer.open(index)
    assert info.value.path == str(index)
    assert time.monotonic() - started < 5


def test_an_index_that_is_a_fifo_or_a_directory_is_refused_without_hanging(
    tmp_path: Path, deadline: Any
) -> None:
    deadline(20)
    fifo = tmp_path / "model.safetensors.index.json"
    os.mkfifo(fifo)
    with pytest.raises(SourceError, match="not a regular file") as info:
        streamer.open(fifo)
    assert info.value.path == str(fifo)
    folder = tmp_path / "d" / "x.safetensors.index.json"
    folder.mkdir(parents=True)
    with pytest.raises(SourceError):
        streamer.open(folder)


def test_a_deeply_nested_index_is_a_source_error(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "x.safetensors"}, "m": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(SourceError) as info:
        streamer.open(index)
    assert info.value.path == str(index)


def test_a_header_naming_more_tensors_than_the_limit_fails_fast_with_bounded_memory(tmp_path: Path) -> None:
    count = MAX_TENSORS + 1
    header = (
        "{"
        + ",".join(f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(count))
        + "}"
    ).encode()
    path = tmp_path / "many.safetensors"
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + count)
    started = time.monotonic()
    with pytest.raises(HeaderError, match="more than") as info:
        streamer.open(path)
    assert info.value.path == str(path)
    assert time.monotonic() - started < 5  # refused before the JSON is read (parsing it: ~7 s here)


def test_a_header_of_array_entries_over_the_limit_is_refused_before_entries_are_checked(
    tmp_path: Path,
) -> None:
    count = MAX_TENSORS + 1  # serde's array form of an entry has no "data_offsets" key to count
    header = ("{" + ",".join(f'"t{i}":["U8",[1],[{i},{i + 1}]]' for i in range(count)) + "}").encode()
    path = tmp_path / "many.safetensors"
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + count)
    with pytest.raises(HeaderError, match="more than") as info:
        streamer.open(path)
    assert info.value.path == str(path)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "engine"])
@pytest.mark.parametrize("replacement", ["fifo", "directory"])
def test_a_file_replaced_by_a_fifo_or_directory_after_open_is_refused_without_hanging(
    tmp_path: Path, inline: bool, replacement: str, deadline: Any
) -> None:
    deadline(30)
    written = write_checkpoint(tmp_path, _tensors(4), index=False)
    path = written.shards[0]
    config = streamer.StreamerConfig(inline_max_bytes="8MiB" if inline else 0)
    with streamer.open(path, config=config) as handle:  # headers read; no data yet
        path.unlink()
        if replacement == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
        with pytest.raises(SourceError, match="not a regular file") as info:
            list(handle)
    assert info.value.path == str(path)

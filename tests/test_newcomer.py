"""What a new user meets: files that are not safetensors said for what they are, messages that
name the right thing, handles that say what they hold, and one way to pass arguments."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from conftest import write_checkpoint

import streamer
from streamer import HeaderError, MissingFileError


def _impostors(directory: Path) -> dict[str, tuple[Path, str]]:
    """(file, what the error must call it) for each common impostor."""
    made: dict[str, tuple[Path, str]] = {}
    zipped = directory / "pytorch_model.bin"
    torch.save({"w": torch.ones(4)}, zipped)
    made["torch.save zip"] = (zipped, "a zip archive, as torch.save writes")
    legacy = directory / "legacy.bin"
    torch.save({"w": torch.ones(4)}, legacy, _use_new_zipfile_serialization=False)
    made["legacy pickle"] = (legacy, "a Python pickle")
    gguf = directory / "model.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(200))
    made["gguf"] = (gguf, "a GGUF file")
    html = directory / "model.safetensors"
    html.write_text("\n<!DOCTYPE html><html><head><title>404 Not Found</title></head></html>\n")
    made["html page"] = (html, "an HTML or XML page")
    lfs = directory / "lfs.safetensors"
    lfs.write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 4939212390\n"
    )
    made["git lfs pointer"] = (lfs, "a Git LFS pointer")
    config = directory / "config.safetensors"
    config.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}')
    made["json"] = (config, "a JSON document")
    return made


def test_files_that_are_not_safetensors_are_named_for_what_they_are(tmp_path: Path) -> None:
    for kind, (path, called) in _impostors(tmp_path).items():
        for call in (streamer.load_file, streamer.open, lambda p: streamer.safe_open(p, "pt")):
            with pytest.raises(HeaderError) as info:
                call(path)
            assert info.value.path == str(path), kind
            assert f"not a safetensors file: this is {called}" in str(info.value), (kind, str(info.value))
            assert "exceeds the limit" not in str(info.value)


def test_a_safetensors_file_with_a_broken_header_is_still_a_plain_header_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(HeaderError, match="exceeds the limit") as info:
        streamer.load_file(path)
    assert "not a safetensors file" not in str(info.value)


def test_missing_paths_say_file_or_directory(tmp_path: Path) -> None:
    with pytest.raises(MissingFileError, match="no such directory"):
        streamer.load(f"{tmp_path}/checkpoint/")
    with pytest.raises(MissingFileError, match="no such file or directory"):
        streamer.load(tmp_path / "checkpoint")
    with pytest.raises(MissingFileError, match=r"no such file \("):
        streamer.load(tmp_path / "model.safetensors")
    write_checkpoint(tmp_path / "real", {"a": torch.ones(2)}, index=False)
    assert list(streamer.load(f"{tmp_path}/real/")) == ["a"]

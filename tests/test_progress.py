"""``streamer.load(..., progress=True)``: a bytes and GB/s bar on stderr, tqdm's or a plain line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_dict, random_tensor, reference_load, write_checkpoint

import streamer
from streamer.observe.progress import ByteProgress


@pytest.fixture
def no_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain fallback, whether or not tqdm is installed here (``None`` in sys.modules: ImportError)."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)


def test_load_with_progress_reports_every_byte(
    tmp_path: Path, no_tqdm: None, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {f"t{i}": random_tensor((256, 64), torch.float32) for i in range(4)}
    written = write_checkpoint(tmp_path, tensors)
    loaded = streamer.load(tmp_path, progress=True)
    assert_same_dict(loaded, reference_load(written.shards))
    lines = capsys.readouterr().err.splitlines()
    total = sum(t.nbytes for t in tensors.values()) / 1e9
    assert lines and lines[-1].startswith(f"Loading weights: {total:.2f}/{total:.2f} GB, ")
    assert lines[-1].endswith(" GB/s")


def test_load_without_progress_is_silent(
    tmp_path: Path, no_tqdm: None, capsys: pytest.CaptureFixture[str]
) -> None:
    write_checkpoint(tmp_path, {"t": random_tensor((1024,), torch.int8)})
    streamer.load(tmp_path)
    assert capsys.readouterr().err == ""


def test_plain_lines_are_rate_limited(no_tqdm: None, capsys: pytest.CaptureFixture[str]) -> None:
    with ByteProgress(1000, desc="x") as bar:
        for _ in range(999):
            bar.update(1)  # within a second: no line until the last byte
        assert capsys.readouterr().err == ""
        bar.update(1)
    assert capsys.readouterr().err.startswith("x: 0.00/0.00 GB, ")


def test_handle_nbytes_is_the_tensor_bytes(tmp_path: Path) -> None:
    tensors = {"a": random_tensor((3, 5), torch.bfloat16), "b": random_tensor((0,), torch.int64)}
    write_checkpoint(tmp_path, tensors)
    with streamer.open(tmp_path) as handle:
        assert handle.nbytes == 3 * 5 * 2

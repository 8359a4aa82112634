"""Read-ahead for ``get_tensor`` walks (``streamer.plan.readahead``): the safetensors idiom
``for k in f.keys(): f.get_tensor(k)`` reads the keys that follow in windows, not one run each.

What must hold: every tensor bit-exact and its own memory, whatever the order of the calls; what is
read ahead stays within one window (``memory_limit`` where smaller); an error is raised by the call
that asks for the tensor it belongs to, never by one for a sound neighbour.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from conftest import (
    KiB,
    assert_same,
    assert_same_dict,
    config,
    loopback_s3_config,
    random_tensor,
    s3_client,
    write_checkpoint,
)

import streamer
from streamer.config import StreamerConfig
from streamer.errors import ReadError
from streamer.handle import Streamer
from streamer.plan.checkpoint import TensorRef
from streamer.plan.readahead import MIN_WINDOW_BYTES, KeyWalk


def _tensors(count: int = 40) -> dict[str, torch.Tensor]:
    """Several dtypes and sizes, and an empty and a 0-d tensor among them."""
    generator = torch.Generator().manual_seed(count)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]
    tensors = {
        f"layers.{i}.w": random_tensor((1000 + 37 * i,), dtypes[i % len(dtypes)], generator)
        for i in range(count)
    }
    tensors["layers.1.empty"] = torch.empty((0, 3), dtype=torch.float32)
    tensors["layers.2.scalar"] = torch.tensor(2.5, dtype=torch.float64)
    return tensors


class ReadSpy:
    """Counts the runs a handle makes for tensors (``read``, ``_read_alone``) and the bytes of each;
    the real reads do the work."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.runs: list[int] = []
        read, read_alone = Streamer.read, Streamer._read_alone

        def spied_read(handle: Streamer, refs: list[TensorRef]) -> list[torch.Tensor]:
            self.runs.append(sum(ref.entry.nbytes for ref in refs))
            return read(handle, refs)

        def spied_read_alone(handle: Streamer, ref: TensorRef) -> torch.Tensor:
            self.runs.append(ref.entry.nbytes)
            return read_alone(handle, ref)

        monkeypatch.setattr(Streamer, "read", spied_read)
        monkeypatch.setattr(Streamer, "_read_alone", spied_read_alone)


def test_a_walk_over_keys_is_exact_and_reads_in_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = write_checkpoint(tmp_path, _tensors(), shards=3)
    spy = ReadSpy(monkeypatch)
    with streamer.safe_open(written.source, "pt", config=config()) as f:
        keys = f.keys()  # safetensors' idiom: keys() (sorted), then a get_tensor per key
        got = {k: f.get_tensor(k) for k in keys}
    assert_same_dict(got, written.tensors)
    # The first key alone, then everything else in one window (far under the smallest one).
    assert spy.runs == [got[sorted(got)[0]].nbytes, written.nbytes - got[sorted(got)[0]].nbytes]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in got.values())
    assert all(end <= begin for (_, end), (begin, _) in itertools.pairwise(spans))


def test_a_handle_walked_as_a_mapping_reads_in_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dict(handle)`` asks for ``keys()`` (checkpoint order) one by one."""
    written = write_checkpoint(tmp_path, _tensors(), shards=2)
    spy = ReadSpy(monkeypatch)
    with streamer.open(written.source, config=config()) as handle:
        got = dict(handle)
    assert_same_dict(got, written.tensors)
    assert len(spy.runs) == 2


@pytest.mark.filterwarnings("ignore:memory_limit .* is smaller than tensor")  # 8 KiB: some are larger
@pytest.mark.parametrize("limit", [8 * KiB, 64 * KiB])
def test_what_is_read_ahead_stays_within_memory_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    written = write_checkpoint(tmp_path, _tensors(), shards=2)
    largest = max(t.nbytes for t in written.tensors.values())
    spy = ReadSpy(monkeypatch)
    with streamer.safe_open(written.source, "pt", config=config(memory_limit=limit)) as f:
        keys = f.keys()
        for k in keys:
            assert_same(f.get_tensor(k), written.tensors[k], k)
    assert all(run <= max(limit, largest) for run in spy.runs)
    assert len(spy.runs) < len(written.tensors)  # windows of several tensors, still
    assert sum(spy.runs) == written.nbytes  # nothing read twice


def test_windows_stay_within_the_auto_budget_of_a_host_short_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no limit given, the auto budget bounds windows: on a host with 64 KiB available it is
    two of the largest tensor."""
    written = write_checkpoint(tmp_path, _tensors(), shards=2)
    largest = max(t.nbytes for t in written.tensors.values())
    monkeypatch.setattr("streamer.destinations.budget.available_memory", lambda: 64 * KiB)
    spy = ReadSpy(monkeypatch)
    with streamer.safe_open(written.source, "pt", config=config()) as f:
        keys = f.keys()
        for k in keys:
            assert_same(f.get_tensor(k), written.tensors[k], k)
    assert max(spy.runs) <= 2 * largest and len(spy.runs) > 2
    assert sum(spy.runs) == written.nbytes


@pytest.mark.parametrize("order", ["random", "every_other", "reversed", "repeated"])
def test_calls_off_the_walk_are_exact_and_read_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    written = write_checkpoint(tmp_path, _tensors(), shards=2)
    keys = sorted(written.tensors)
    asked = {
        "random": random.Random(7).sample(keys, len(keys)),
        "every_other": keys[::2],
        "reversed": keys[::-1],
        "repeated": [k for k in keys[:5] for _ in range(3)],
    }[order]
    spy = ReadSpy(monkeypatch)
    with streamer.safe_open(written.source, "pt", config=config()) as f:
        got = [f.get_tensor(k) for k in asked]
    for k, t in zip(asked, got, strict=True):
        assert_same(t, written.tensors[k], k)
    if order in ("every_other", "reversed", "repeated"):
        assert len(spy.runs) == len(asked)  # no neighbours asked: nothing read ahead
    if order == "repeated":  # each call its own memory
        sized = [t for t in got if t.numel()]
        assert len({t.data_ptr() for t in sized}) == len(sized) > 3


def test_walking_on_after_a_jump_reads_ahead_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written = write_checkpoint(tmp_path, _tensors(), shards=2)
    keys = sorted(written.tensors)
    asked = keys[:10] + keys[30:] + keys[10:30]
    spy = ReadSpy(monkeypatch)
    with streamer.safe_open(written.source, "pt", config=config()) as f:
        for k in asked:
            assert_same(f.get_tensor(k), written.tensors[k], k)
    assert len(spy.runs) <= 6  # each stretch: one alone, then one window


def test_an_error_is_raised_by_the_call_for_its_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window after ``a`` holds ``b`` (sound) and ``c`` (cut off by a truncated file): asking
    for ``b`` returns it; asking for ``c`` raises, naming it."""
    tensors = {name: torch.full((20_000,), i, dtype=torch.int32) for i, name in enumerate("abc")}
    written = write_checkpoint(tmp_path, tensors, index=False)
    path = written.shards[0]
    spy = ReadSpy(monkeypatch)
    with streamer.safe_open(path, "pt", config=config()) as f:
        assert_same(f.get_tensor("a"), tensors["a"])
        os.truncate(path, path.stat().st_size - 40_000)
        assert_same(f.get_tensor("b"), tensors["b"])
        with pytest.raises(ReadError) as raised:
            f.get_tensor("c")
    assert "'c'" in str(raised.value) and str(path) in str(raised.value)
    assert spy.runs == [80_000, 160_000, 80_000, 80_000]  # the window failed; b and c read alone


def test_threads_sharing_one_walk_get_exact_tensors(tmp_path: Path) -> None:
    written = write_checkpoint(tmp_path, _tensors(60), shards=2)
    keys = sorted(written.tensors)
    failures: list[BaseException] = []
    with streamer.safe_open(written.source, "pt", config=config()) as f:

        def walk(names: list[str]) -> None:
            try:
                for k in names:
                    assert_same(f.get_tensor(k), written.tensors[k], k)
            except BaseException as error:  # handed to the main thread
                failures.append(error)

        threads = [threading.Thread(target=walk, args=(keys[i::2],)) for i in range(2)]
        threads.append(threading.Thread(target=walk, args=(keys,)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not failures, failures
    assert not any(thread.is_alive() for thread in threads)


def test_windows_grow_to_their_cap_and_never_past_it() -> None:
    """The window doubles with each one used up, from ``MIN_WINDOW_BYTES`` to its cap."""
    sizes = {f"k{i:03d}": 4 << 20 for i in range(200)}
    reads: list[list[str]] = []

    def read(names: list[str]) -> list[torch.Tensor]:
        reads.append(names)
        return [torch.empty(0) for _ in names]

    walk = KeyWalk(
        sorted(sizes), lambda name: read([name])[0], read, sizes.__getitem__, max_window_bytes=64 << 20
    )
    for name in sorted(sizes):
        walk.get(name)
    window_bytes = [sum(sizes[n] for n in names) for names in reads]
    assert window_bytes[:4] == [4 << 20, MIN_WINDOW_BYTES, 2 * MIN_WINDOW_BYTES, 64 << 20]
    assert max(window_bytes) == 64 << 20 and walk.windows == len(reads) - 1
    walk.clear()
    walk.get("k100")
    assert reads[-1] == ["k100"]


def test_a_walk_over_an_s3_checkpoint_reads_in_windows(
    s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("boto3")
    credentials = ("AKIDWALKTEST", "walk/secret", "walk-token")
    written = write_checkpoint(tmp_path, _tensors(), shards=2)
    client = s3_client(s3_server, credentials[0], credentials[1])
    client.create_bucket(Bucket="walk")
    for path in (*written.shards, written.index):
        assert path is not None
        client.upload_file(str(path), "walk", f"ckpt/{path.name}")
    cfg = StreamerConfig(concurrency=2, s3=loopback_s3_config(s3_server, credentials))
    spy = ReadSpy(monkeypatch)
    with streamer.safe_open("s3://walk/ckpt/", config=cfg) as f:
        keys = f.keys()
        got = {k: f.get_tensor(k) for k in keys}
        assert f.handle.metrics["s3_files"] >= 1
    assert_same_dict(got, written.tensors)
    assert len(spy.runs) == 2

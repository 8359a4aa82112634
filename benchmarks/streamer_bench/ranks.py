"""``streamer-bench --ranks N``: N processes load the checkpoint as one gloo group, against the
same N processes loading it independently, interleaved round by round.

Each run starts N fresh processes (``torch.multiprocessing`` spawn) that meet in a gloo group on
127.0.0.1, wait at a barrier, then load: with ``group=`` (each reads about ``1/N`` and receives
the rest) or alone (each reads everything). Wall time is from the first rank's start to the last
rank's end, i.e. until every rank holds the checkpoint; bytes read and S3 requests are summed
over the ranks, and the exchange time is the slowest rank's. Local sources are made cold (or
warm) before each run, as ``--cold``/``--warm`` say.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import streamer
from streamer_bench import pagecache, stats
from streamer_bench.files import CheckpointFiles
from streamer_bench.units import format_bytes

MODES = ("group", "independent")


def _rank(rank: int, world: int, init: str, source: str, grouped: bool, keep: bool, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        dist.barrier()
        started = time.time()
        # keep: what streamer.load() does (every tensor kept, so no memory limit), with metrics.
        config = streamer.StreamerConfig(memory_limit="unlimited") if keep else None
        with streamer.open(source, config=config, group=dist.group.WORLD if grouped else None) as handle:
            kept = {name: tensor for name, tensor in handle if keep}
            metrics = handle.metrics
        del kept
        ended = time.time()
        torch.save({"started": started, "ended": ended, "metrics": metrics}, Path(out) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one_run(source: str, world: int, grouped: bool, keep: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="streamer-ranks-") as tmp:
        spawn = mp.get_context("spawn")
        processes = [
            spawn.Process(target=_rank, args=(r, world, f"{tmp}/init", source, grouped, keep, tmp))
            for r in range(world)
        ]
        try:
            for process in processes:
                process.start()
            for process in processes:
                process.join()
        except BaseException:  # a stop (Ctrl-C, SIGTERM): no rank outlives the bench
            for process in processes:
                if process.pid is not None:
                    process.kill()
                    process.join()
            raise
        failed = [r for r, p in enumerate(processes) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"ranks {failed} of a {'group' if grouped else 'independent'} run failed")
        ranks = [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(world)]
    metrics = [r["metrics"] for r in ranks]
    return {
        "mode": "group" if grouped else "independent",
        "wall_s": max(r["ended"] for r in ranks) - min(r["started"] for r in ranks),
        "bytes_read_per_rank": [m["bytes_read"] for m in metrics],
        "bytes_read_group": sum(m["bytes_read"] for m in metrics),
        "s3_requests_group": sum(m["requests"] for m in metrics),
        "exchange_s": max((m.get("group", {}).get("exchange_seconds", 0.0) for m in metrics), default=0.0),
    }


def bench(
    checkpoint: CheckpointFiles,
    world: int,
    repeat: int,
    states: list[str],
    progress: Any,
    *,
    keep: bool = False,
) -> dict[str, Any]:
    """Every state's interleaved runs of both modes, their medians, and the paired per-round ratio of
    the independent loads' wall time over the group's (above 1: the group is faster) with its
    bootstrap interval and verdict (``stats.compare``). ``keep``: every rank keeps every tensor, as
    ``streamer.load()`` does; else each is dropped as it streams in."""
    sections = []
    for state in states:
        runs: list[dict[str, Any]] = []
        for round_ in range(repeat):
            for mode in MODES:
                if state == "cold":
                    pagecache.make_cold(checkpoint.files)
                elif state == "warm":
                    pagecache.make_warm(checkpoint.files)
                progress(f"{state} round {round_ + 1}/{repeat}: {world} ranks, {mode}")
                runs.append({"round": round_, **_one_run(checkpoint.source, world, mode == "group", keep)})
        medians = {
            mode: {
                key: statistics.median(r[key] for r in runs if r["mode"] == mode)
                for key in ("wall_s", "bytes_read_group", "s3_requests_group", "exchange_s")
            }
            for mode in MODES
        }
        walls = {mode: {r["round"]: r["wall_s"] for r in runs if r["mode"] == mode} for mode in MODES}
        paired = stats.compare(walls["group"], walls["independent"])  # independent ÷ group, per round
        sections.append(
            {"state": state, "runs": runs, "medians": medians, "paired": dataclasses.asdict(paired)}
        )
    return {"ranks": world, "keep": keep, "tensor_bytes": checkpoint.tensor_bytes, "sections": sections}


def render(doc: dict[str, Any]) -> str:
    kept = "every rank keeps every tensor" if doc["keep"] else "tensors dropped as they stream in"
    lines = [f"{doc['ranks']} ranks, checkpoint {format_bytes(doc['tensor_bytes'])}, {kept} (medians)"]
    lines.append(
        f"{'state':8} {'mode':12} {'wall s':>8} {'read/group':>12} {'x ckpt':>7} {'S3 req':>7} {'exch s':>7}"
    )
    for section in doc["sections"]:
        for mode, m in section["medians"].items():
            read = m["bytes_read_group"]
            lines.append(
                f"{section['state']:8} {mode:12} {m['wall_s']:8.2f} {format_bytes(int(read)):>12} "
                f"{read / max(doc['tensor_bytes'], 1):7.2f} {int(m['s3_requests_group']):7d} "
                f"{m['exchange_s']:7.2f}"
            )
        group, alone = section["medians"]["group"], section["medians"]["independent"]
        lines.append(f"{section['state']:8} group/independent wall: {group['wall_s'] / alone['wall_s']:.2f}x")
        paired = section["paired"]
        interval = f" [{paired['low']:.2f}, {paired['high']:.2f}]" if paired["low"] is not None else ""
        ratio = f"{paired['ratio']:.2f}x" if paired["ratio"] is not None else "-"
        lines.append(
            f"{section['state']:8} independent/group wall per round: {ratio}{interval} over "
            f"{paired['rounds']} rounds: the group is {paired['verdict']}"
        )
    return "\n".join(lines)

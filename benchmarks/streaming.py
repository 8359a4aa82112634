#!/usr/bin/env python3
"""Issue 18's check: streaming a checkpoint larger than RAM at the default ``memory_limit``.

Generates (once, reused when its manifest matches) a checkpoint of ``--tensor``-sized BF16
tensors and one ``--big`` tensor, ``--size`` bytes in all, in shards of at most ``--shard``
bytes under ``--dir``. Each run is a fresh process that streams it cold (page cache evicted with
posix_fadvise and verified empty with mincore) with ``for name, t in handle`` dropping every
tensor, and reports GB/s, peak RSS (VmHWM, reset after start-up), minor faults, CPU seconds,
the budget in force and every warning; it checks slices of every tensor byte for byte.
Settings run in interleaved rounds; the summary gives each setting's median and the median of
the per-round ratios of the first setting to the last with its bootstrap 95% interval
(``streamer_bench.stats``: at least 5 rounds for an interval).

    python benchmarks/streaming.py --dir /var/tmp/streaming --json streaming.json   # 28 GiB, 5 rounds
    python benchmarks/streaming.py --dir /tmp/s --size 2GiB --tensor 256MiB --big 512MiB --rounds 2

A standalone script rather than a ``streamer-bench`` subcommand: it judges one loader against
itself under different budgets, with a consumer that drops tensors, which the peer comparison
(every loader keeps every tensor) does not model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamer.config.fields import parse_size
from streamer_bench import pagecache, stats

MiB = 1 << 20
GiB = 1 << 30
PATTERN_BYTES = 16 * MiB  # one random block, tiled: generating costs a memcpy, not an RNG pass
SAMPLE_BYTES = 4096  # checked at the start, middle and end of every tensor
RSS_ALLOWANCE = 256 * MiB  # the issue's bound: peak RSS growth <= budget + this
MANIFEST = "streaming-manifest.json"


def pattern() -> np.ndarray:
    """The tiled block, twice over, so that any rotation of it is one contiguous slice."""
    block = np.random.default_rng(18).integers(0, 256, PATTERN_BYTES, dtype=np.uint8)
    return np.concatenate([block, block])


def rotation(index: int) -> int:
    """Where tensor ``index``'s bytes start in the pattern: each tensor's bytes differ."""
    return (index * 1_000_003 * 4099) % PATTERN_BYTES


def expected(doubled: np.ndarray, index: int, offset: int, length: int) -> np.ndarray:
    start = (rotation(index) + offset) % PATTERN_BYTES
    return doubled[start : start + length]  # length <= PATTERN_BYTES


def layout(size: int, tensor: int, big: int, shard: int) -> list[list[tuple[str, int]]]:
    """Shards of (name, nbytes): tensors of ``tensor`` bytes, one of ``big`` bytes in the middle."""
    count = max((size - big) // tensor, 1)
    sizes = [tensor] * count
    sizes.insert(count // 2, big)
    shards: list[list[tuple[str, int]]] = [[]]
    used = 0
    for index, nbytes in enumerate(sizes):
        if shards[-1] and used + nbytes > shard:
            shards.append([])
            used = 0
        shards[-1].append((f"layers.{index:03d}.weight", nbytes))
        used += nbytes
    return shards


def generate(directory: Path, shards: list[list[tuple[str, int]]]) -> None:
    """Writes the shards and their index, unless a matching manifest says they are there."""
    manifest = {"shards": shards, "pattern": PATTERN_BYTES}
    manifest_path = directory / MANIFEST
    if manifest_path.exists() and json.loads(manifest_path.read_text()) == json.loads(json.dumps(manifest)):
        print(f"reusing the checkpoint in {directory}", file=sys.stderr)
        return
    total = sum(nbytes for shard in shards for _, nbytes in shard)
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < total + GiB:
        raise SystemExit(
            f"{directory}: {free / GiB:.1f} GiB free, the checkpoint needs {total / GiB:.1f} GiB"
        )
    manifest_path.unlink(missing_ok=True)
    doubled = pattern()
    weight_map: dict[str, str] = {}
    index = 0
    started = time.perf_counter()
    for number, shard in enumerate(shards):
        file_name = f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, nbytes in shard:
            header[name] = {
                "dtype": "BF16",
                "shape": [nbytes // 2],
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file_name
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(directory / file_name, "wb") as out:
            out.write(len(encoded).to_bytes(8, "little") + encoded)
            for _, nbytes in shard:
                start = rotation(index)
                written = 0
                while written < nbytes:
                    piece = min(PATTERN_BYTES, nbytes - written)
                    position = (start + written) % PATTERN_BYTES
                    out.write(doubled[position : position + piece].tobytes())
                    written += piece
                index += 1
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json))
    manifest_path.write_text(json.dumps(manifest))
    seconds = time.perf_counter() - started
    print(f"generated {total / GiB:.1f} GiB in {seconds:.0f} s in {directory}", file=sys.stderr)


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(request: dict[str, Any]) -> dict[str, Any]:
    """One cold streaming pass in this fresh process; what it measured."""
    import resource
    import warnings

    import streamer

    setting = request["setting"]
    if setting == "default":
        config = streamer.StreamerConfig()
    elif setting == "unlimited":
        config = streamer.StreamerConfig(memory_limit="unlimited")
    else:
        config = streamer.StreamerConfig(memory_limit=parse_size(setting, name="--settings"))
    doubled = pattern()
    order = [name for shard in request["shards"] for name, _ in shard]
    position = {name: i for i, name in enumerate(order)}
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS: the peak below is the load's, not start-up's
    baseline = _status("VmRSS")
    before = resource.getrusage(resource.RUSAGE_SELF)
    wrong: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.perf_counter()
        with streamer.open(request["source"], config=config) as handle:
            for name, tensor in handle:
                raw = tensor.view(-1).view(torch.uint8).numpy()
                for offset in (0, raw.size // 2, raw.size - SAMPLE_BYTES):
                    want = expected(doubled, position[name], offset, SAMPLE_BYTES)
                    if not np.array_equal(raw[offset : offset + SAMPLE_BYTES], want):
                        wrong.append(f"{name}@{offset}")
                del raw, tensor
            seconds = time.perf_counter() - started
            metrics = handle.metrics
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "setting": setting,
        "seconds": seconds,
        "gb_per_s": metrics["bytes"] / seconds / 1e9,
        "bytes": metrics["bytes"],
        "tensors": metrics["tensors"],
        "memory_limit": metrics["memory_limit"],
        "memory_limit_source": metrics["memory_limit_source"],
        "peak_buffer_bytes": metrics["peak_buffer_bytes"],
        "baseline_rss": baseline,
        "peak_rss": _status("VmHWM"),
        "ru_maxrss": after.ru_maxrss * 1024,
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "wrong_samples": wrong,
        "metrics": metrics,
    }


def run_once(
    source: Path, files: list[Path], shards: list[list[tuple[str, int]]], setting: str
) -> dict[str, Any]:
    resident = pagecache.evict_and_verify(files)
    if resident:
        raise SystemExit(f"not cold: {resident} bytes still in the page cache after eviction")
    request = {"source": str(source), "setting": setting, "shards": shards}
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(request)],
        capture_output=True,
        text=True,
        check=False,
        cwd=source.parent,
    )
    if out.returncode != 0:
        raise SystemExit(f"the {setting} run failed:\n{out.stderr}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def summarize(runs: list[dict[str, Any]], settings: list[str]) -> dict[str, Any]:
    by_setting = {s: [r for r in runs if r["setting"] == s] for s in settings}
    summary: dict[str, Any] = {"settings": {}}
    for setting, results in by_setting.items():
        speeds = [r["gb_per_s"] for r in results]
        growth = [r["peak_rss"] - r["baseline_rss"] for r in results]
        summary["settings"][setting] = {
            "gb_per_s_median": statistics.median(speeds),
            "gb_per_s_min": min(speeds),
            "gb_per_s_max": max(speeds),
            "memory_limit": results[0]["memory_limit"],
            "memory_limit_source": results[0]["memory_limit_source"],
            "peak_rss_growth_max": max(growth),
            "peak_buffer_bytes_max": max(r["peak_buffer_bytes"] for r in results),
            "minor_faults_median": statistics.median(r["minor_faults"] for r in results),
            "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in results),
            "warnings": sum(len(r["warnings"]) for r in results),
            "wrong_samples": sum(len(r["wrong_samples"]) for r in results),
        }
    first, last = settings[0], settings[-1]
    # Same bytes in every run, so seconds per round are proportional to 1 / GB/s.
    paired = stats.compare(
        {r["round"]: 1 / r["gb_per_s"] for r in by_setting[first]},
        {r["round"]: 1 / r["gb_per_s"] for r in by_setting[last]},
    )
    ratios = [a["gb_per_s"] / b["gb_per_s"] for a, b in zip(by_setting[first], by_setting[last], strict=True)]
    summary["ratio"] = {"of": first, "to": last, "per_round": ratios, "median": paired.ratio,
                        "ci95": [paired.low, paired.high], "verdict": paired.verdict}  # fmt: skip
    judged = summary["settings"][first]
    limit = judged["memory_limit"]
    summary["checks"] = {
        "no_warning": judged["warnings"] == 0,
        "bit_exact_samples": all(s["wrong_samples"] == 0 for s in summary["settings"].values()),
        "peak_rss_within_budget_plus_256MiB": limit is not None
        and judged["peak_rss_growth_max"] <= limit + RSS_ALLOWANCE,
        "throughput_at_least_0.9x": paired.ratio is not None and paired.ratio >= 0.9,
    }
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    for setting, s in summary["settings"].items():
        limit = "unbounded" if s["memory_limit"] is None else f"{s['memory_limit'] / GiB:.2f} GiB"
        print(
            f"{setting:>10}: {s['gb_per_s_median']:.2f} GB/s (min {s['gb_per_s_min']:.2f}, max "
            f"{s['gb_per_s_max']:.2f}); budget {limit} [{s['memory_limit_source']}]; peak RSS growth "
            f"{s['peak_rss_growth_max'] / GiB:.2f} GiB, peak buffers "
            f"{s['peak_buffer_bytes_max'] / GiB:.2f} GiB; "
            f"{s['minor_faults_median']:.0f} minor faults, {s['cpu_seconds_median']:.1f} CPU s; "
            f"{s['warnings']} warning(s), {s['wrong_samples']} wrong sample(s)"
        )
    ratio = summary["ratio"]
    per_round = ", ".join(f"{r:.3f}" for r in ratio["per_round"])
    low, high = ratio["ci95"]
    interval = f"bootstrap 95% [{low:.3f}, {high:.3f}]" if low is not None else "no interval"
    print(
        f"{ratio['of']} / {ratio['to']} GB/s: median {ratio['median']:.3f}, {interval} ({ratio['verdict']}) "
        f"over rounds ({per_round})"
    )
    for check, passed in summary["checks"].items():
        print(f"{'PASS' if passed else 'FAIL'} {check}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, help="where the checkpoint is generated (or reused)")
    parser.add_argument(
        "--size", default="28GiB", help="checkpoint bytes (default 28GiB: above a 24 GiB host's RAM)"
    )
    parser.add_argument("--tensor", default="1GiB", help="bytes of each ordinary tensor")
    parser.add_argument("--big", default="2GiB", help="bytes of the one large tensor")
    parser.add_argument("--shard", default="4GiB", help="most bytes per shard")
    parser.add_argument("--settings", default="default,8GiB",
                        help="memory_limit per setting: default, unlimited or a size; the first is "
                             "judged against the last (default: default,8GiB)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.dir is None:
        parser.error("--dir is required")
    sizes = {
        key: parse_size(getattr(args, key), name=f"--{key}") for key in ("size", "tensor", "big", "shard")
    }
    if sizes["tensor"] % 2 or sizes["big"] % 2 or sizes["tensor"] < 3 * SAMPLE_BYTES:
        parser.error("--tensor and --big must be even (BF16) and at least 12 KiB")
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    shards = layout(sizes["size"], sizes["tensor"], sizes["big"], sizes["shard"])
    generate(args.dir, shards)
    files = sorted(args.dir.glob("model-*.safetensors"))
    source = args.dir / "model.safetensors.index.json"
    runs = []
    for round_number in range(args.rounds):
        order = settings if round_number % 2 == 0 else settings[::-1]  # neither always goes first
        for setting in order:
            result = run_once(source, files, shards, setting)
            result["round"] = round_number
            runs.append(result)
            print(
                f"round {round_number + 1} {setting}: {result['gb_per_s']:.2f} GB/s, peak RSS growth "
                f"{(result['peak_rss'] - result['baseline_rss']) / GiB:.2f} GiB, "
                f"{len(result['warnings'])} warning(s)",
                file=sys.stderr,
            )
    summary = summarize(runs, settings)
    print_summary(summary)
    if args.json is not None:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "summary": summary}, indent=1))
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""The node cache in front of an object store (``StreamerConfig.cache``): second start against
first, against the same checkpoint as plain local files, and against Run:ai's loader of the
store, paired by round. S3 first, and ``gs://`` and ``az://`` sources alike (the endpoint and
credentials from the environment, as ``streamer-bench --source`` takes them).

    python benchmarks/s3_cache.py --local DIR --source s3://bench/ckpt-4GiB-2/ --repeat 5
    STORAGE_EMULATOR_HOST=http://127.0.0.1:4443 python benchmarks/s3_cache.py --local DIR \
        --source gs://bench/ckpt-1GiB-2/ --settings "local cold,hit cold"

``DIR`` holds the checkpoint's files, ``--source`` the same files in a bucket (``s3_load.py
--keep DIR`` generates and uploads both; point ``AWS_ENDPOINT_URL`` at the shaped endpoint).
Every round runs, shuffled after the first (``runner.round_order``), each in a fresh process
(``streamer_bench.child``) started ``--settle`` seconds after the last (``streamer-bench
--settle``):

  - "local cold":  streamer from ``DIR``, its page cache evicted;
  - "hit cold":    streamer from S3 through a full cache, the cache's files evicted (the
                   second start on a node whose page cache has moved on);
  - "fill":        streamer from S3 into an emptied cache (the first start);
  - "no cache":    streamer from S3 without a cache;
  - "runai s3":    Run:ai's loader of the source's store, when its package is installed
                   (``runai_model_streamer_s3``, ``_gcs``, ``_azure``).

``--settings`` runs some of them: a hit makes no data GET, so its comparison with local files
may use an endpoint that serves GETs slower than the one the fill is measured against.

Reported: median seconds, and the paired per-round ratios the issue's goals are about, with
bootstrap intervals (``streamer_bench.stats``): local cold ÷ hit cold (≥ 0.9: hits read at disk
speed), no cache ÷ fill (≥ 0.9: filling costs the first start little), and the first and second
start against Run:ai. The first two again for the run alone (the load's ``seconds`` metric):
without the S3 session an ``s3://`` load opens first (imports, client, listing, headers), a
fixed cost that a larger checkpoint spreads thinner.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from streamer_bench import runner, stats
from streamer_bench.units import nonnegative_seconds

CACHE_COUNTERS = ("cache_hit_bytes", "cache_miss_bytes", "cache_write_bytes")
RUNAI_PACKAGES = {
    "s3": "runai_model_streamer_s3",
    "gs": "runai_model_streamer_gcs",
    "az": "runai_model_streamer_azure",
}
SETTINGS = ("local cold", "hit cold", "fill", "no cache", "runai s3")
RATIOS = (  # (numerator, denominator, what a ratio above 1 means)
    ("local cold", "hit cold", "hit faster than local files"),
    ("no cache", "fill", "fill faster than no cache"),
    ("runai s3", "fill", "first start faster than Run:ai"),
    ("runai s3", "hit cold", "second start faster than Run:ai"),
    ("no cache", "hit cold", "second start faster than the first without cache"),
)


def settings_list(text: str) -> list[str]:
    """``--settings``: a comma-separated subset of ``SETTINGS``, run in ``SETTINGS`` order."""
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(SETTINGS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"settings are some of {', '.join(SETTINGS)}; got {text!r}")
    return [s for s in SETTINGS if s in chosen]


def fill_completely(source: str, cache_dir: Path) -> None:
    """The cache every hit reads: loads until nothing misses (a fill drops chunks its writer
    cannot take), five at most."""
    for _ in range(5):
        metrics = run_child(request("streamer", source, [], None), cache_dir)["metrics"]
        if metrics["cache_miss_bytes"] == 0:
            return
    print(f"the cache is still partial after 5 loads: {metrics}", flush=True)


def run_child(request: dict[str, Any], cache_dir: Path | None) -> dict[str, Any]:
    """One timed load in a fresh process, with the cache at ``cache_dir`` or none."""
    env = runner.child_env({})
    env.pop("STREAMER_CACHE_DIR", None)
    if cache_dir is not None:
        env["STREAMER_CACHE_DIR"] = str(cache_dir)
    result = runner.call_child(request, env=env)
    if not result["ok"]:
        raise RuntimeError(result["error"])
    return result


def chunk_files(cache_dir: Path) -> list[str]:
    return sorted(str(p) for p in cache_dir.glob("v*/*/*.chunk"))


def request(loader: str, source: str, files: list[str], cache: str | None) -> dict[str, Any]:
    return {
        "action": "load",
        "loader": loader,
        "source": source,
        "files": files,
        "device": "cpu",
        "knobs": {},
        "cache": cache,
    }


def setting_request(
    setting: str, args: argparse.Namespace, local_files: list[str], full: Path, filling: Path
) -> tuple[dict[str, Any], Path | None]:
    """The child's request for one run of ``setting``, and the cache directory it runs with."""
    if setting == "local cold":
        return request("streamer", str(args.local), local_files, "cold"), None
    if setting == "hit cold":
        return request("streamer", args.source, chunk_files(full), "cold"), full
    if setting == "fill":
        shutil.rmtree(filling, ignore_errors=True)
        return request("streamer", args.source, [], None), filling
    if setting == "no cache":
        return request("streamer", args.source, [], None), None
    remote_files = [args.source.rstrip("/") + "/" + Path(p).name for p in local_files]
    return request("runai", args.source, remote_files, None), None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local", type=Path, required=True, help="the checkpoint's directory")
    parser.add_argument(
        "--source", required=True, help="the same files in a store: s3://bucket/prefix/ (or gs://, az://)"
    )
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/streamer-cache-bench"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--settle",
        type=nonnegative_seconds,
        default=runner.default_settle(),
        help="seconds before each run, as streamer-bench --settle (3 on a VM with free page reporting)",
    )
    parser.add_argument(
        "--settings",
        type=settings_list,
        default=list(SETTINGS),
        help=f"comma-separated, of: {', '.join(SETTINGS)} (default: all)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    local_files = sorted(str(p) for p in args.local.glob("*.safetensors"))
    full, filling = args.work / "full", args.work / "filling"
    shutil.rmtree(args.work, ignore_errors=True)
    settings = list(args.settings)
    if "hit cold" in settings:
        fill_completely(args.source, full)
    runai_package = RUNAI_PACKAGES[args.source.partition("://")[0]]
    if importlib.util.find_spec(runai_package) is None and "runai s3" in settings:
        settings.remove("runai s3")
        print(f"{runai_package} is not installed: no Run:ai figures", flush=True)

    seconds: dict[str, dict[int, float]] = {s: {} for s in settings}
    run_seconds: dict[str, dict[int, float]] = {s: {} for s in settings if s != "runai s3"}
    records: list[dict[str, Any]] = []
    stopped: runner.Interrupted | None = None
    try:
        with runner.stopping_on_signals():
            for round_number in range(args.repeat):
                for setting in runner.round_order(settings, round_number):
                    req, cache_dir = setting_request(setting, args, local_files, full, filling)
                    time.sleep(args.settle)
                    result = run_child(req, cache_dir)
                    seconds[setting][round_number] = result["seconds"]
                    metrics = result.get("metrics") or {}
                    if setting in run_seconds:
                        run_seconds[setting][round_number] = metrics["seconds"]
                    cached = {k: metrics.get(k) for k in CACHE_COUNTERS}
                    records.append({"round": round_number, "setting": setting, **result})
                    print(
                        f"round {round_number} {setting:>10}: {result['seconds']:7.3f} s "
                        f"{result['bytes'] / result['seconds'] / 1e9:5.2f} GB/s "
                        f"cpu {result['cpu_seconds']:.2f} s "
                        f"faults {result['minor_faults']} {cached if cache_dir else ''}",
                        flush=True,
                    )
    except runner.Interrupted as stop:
        stopped = stop
        print(f"{stop.signal}: stopped; figures from the runs that finished", flush=True)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)

    print(
        "\nmedian seconds: "
        + ", ".join(f"{s} {statistics.median(seconds[s].values()):.3f}" for s in settings if seconds[s])
    )
    print(
        "median run seconds (the S3 session left out): "
        + ", ".join(f"{s} {statistics.median(t.values()):.3f}" for s, t in run_seconds.items() if t)
    )
    verdicts = []
    for clock, times, ratios in (("load", seconds, RATIOS), ("run", run_seconds, RATIOS[:2])):
        for numerator, denominator, meaning in ratios:
            if numerator not in times or denominator not in times:
                continue
            # compare(ours, theirs) is theirs / ours per round: the numerator is "theirs".
            paired = stats.compare(times[denominator], times[numerator])
            verdicts.append({"compared": f"{numerator} / {denominator}", "clock": clock, **paired.__dict__})
            low = "-" if paired.low is None else f"{paired.low:.2f}"
            high = "-" if paired.high is None else f"{paired.high:.2f}"
            ratio = "-" if paired.ratio is None else f"{paired.ratio:.2f}"
            print(
                f"{clock}: {numerator} / {denominator}: {ratio} [{low}, {high}] "
                f"({paired.verdict}; above 1: {meaning})"
            )
    if args.json is not None:
        interrupted = stopped.signal if stopped else None
        args.json.write_text(
            json.dumps({"runs": records, "ratios": verdicts, "interrupted": interrupted}, indent=1)
        )
    return stopped.exit_status if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())

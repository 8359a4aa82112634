"""What recording a load in Prometheus costs: a warm load with ``metrics`` on against off, paired.

    python benchmarks/metrics_overhead.py [--size 1GiB] [--repeat 20]

A checkpoint of ``--size`` (16 float32 tensors in two shards) is written to ``/var/tmp`` and read
once to warm the page cache; each round then loads it with ``StreamerConfig(metrics=False)`` and
``StreamerConfig(metrics=True)`` in one process, in alternating order, and the per-round ratio
(on ÷ off: above 1, recording slowed the load) is reported with its bootstrap 95% interval
(``streamer_bench.stats``). One process, so that both settings see the same heap and page cache;
the first load of each setting (imports, the collectors' creation) is not timed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

import streamer
from streamer.config.fields import parse_size
from streamer_bench import stats

SETTINGS = {"off": streamer.StreamerConfig(metrics=False), "on": streamer.StreamerConfig(metrics=True)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="1GiB", help="checkpoint size (default 1GiB)")
    parser.add_argument("--repeat", type=int, default=20, help="rounds (default 20)")
    args = parser.parse_args()
    size = parse_size(args.size, name="--size")
    with tempfile.TemporaryDirectory(prefix="metrics-overhead-", dir="/var/tmp") as directory:
        elements = size // 4 // 16
        g = torch.Generator().manual_seed(1)
        for shard in range(2):
            tensors = {f"s{shard}.t{i}": torch.randn(elements, generator=g) for i in range(8)}
            safetensors.torch.save_file(tensors, f"{directory}/model-{shard}.safetensors")
            del tensors
        source = Path(directory)
        seconds: dict[str, dict[int, float]] = {name: {} for name in SETTINGS}
        for config in SETTINGS.values():
            streamer.load(source, config=config)  # warm: the page cache, imports, the collectors
        for round_ in range(args.repeat):
            order = list(SETTINGS) if round_ % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                gc.collect()
                started = time.perf_counter()
                loaded = streamer.load(source, config=SETTINGS[name])
                seconds[name][round_] = time.perf_counter() - started
                del loaded
    paired = stats.compare(seconds["off"], seconds["on"])
    medians = {name: statistics.median(values.values()) for name, values in seconds.items()}
    print(f"warm {args.size}, one process, {args.repeat} rounds, alternating order")
    print(f"  metrics off: {medians['off']:.3f} s   metrics on: {medians['on']:.3f} s (median)")
    interval = f"[{paired.low:.3f}, {paired.high:.3f}]" if paired.low is not None else "(too few rounds)"
    meaning = {"ahead": "recording slowed loads", "behind": "loads with recording were faster"}
    verdict = meaning.get(paired.verdict, "no separable difference")
    print(f"  on ÷ off per round: {paired.ratio:.3f}x {interval}: {verdict}")


if __name__ == "__main__":
    main()

"""A tensor-parallel shard by ``get_slice`` against reading the whole weight, paired by round.

    python benchmarks/slice_load.py [--rows 16384] [--cols 16384] [--repeat 7] [--cold]

One bf16 weight of ``rows x cols`` is written to a temporary file; each round reads, in an
alternating order, the whole weight (``get_tensor``) and the column shard ``[:, :cols/8]``,
the file warm in the page cache (or evicted before each read with ``--cold``). Reported: each
read's median seconds and ``bytes_read``, and the paired per-round ratio (whole ÷ shard) with
its bootstrap interval: above 1, the shard is faster (``streamer.bench.stats``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import safetensors.torch
import torch

import streamer
from streamer.bench import cache, stats


def timed(path: Path, shard: bool, cold: bool) -> tuple[float, int]:
    if cold:
        cache.make_cold([str(path)])
    with streamer.safe_open(path) as handle:
        started = time.perf_counter()
        if shard:
            handle.get_slice("weight")[:, : handle.get_slice("weight").get_shape()[1] // 8]
        else:
            handle.get_tensor("weight")
        seconds = time.perf_counter() - started
        return seconds, int(handle.handle.metrics["bytes_read"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="slice-load-", dir="/var/tmp") as directory:
        path = Path(directory) / "weight.safetensors"
        weight = torch.randn(args.rows, args.cols).to(torch.bfloat16)
        safetensors.torch.save_file({"weight": weight}, str(path))
        del weight
        whole: dict[int, float] = {}
        shard: dict[int, float] = {}
        read = {"whole": 0, "shard": 0}
        for round_ in range(args.repeat):
            for is_shard in (round_ % 2 == 0, round_ % 2 != 0):
                seconds, nbytes = timed(path, is_shard, args.cold)
                (shard if is_shard else whole)[round_] = seconds
                read["shard" if is_shard else "whole"] = nbytes
        state = "cold" if args.cold else "warm"
        print(f"{args.rows}x{args.cols} bf16, {state}, {args.repeat} rounds")
        for name, runs in (("whole", whole), ("shard [:, :cols/8]", shard)):
            key = "shard" if name.startswith("shard") else "whole"
            print(f"  {name:20} median {statistics.median(runs.values()):.3f} s, bytes_read {read[key]:,}")
        paired = stats.compare(shard, whole)  # per round: whole seconds / shard seconds
        interval = f"[{paired.low:.2f}, {paired.high:.2f}]" if paired.low is not None else ""
        print(f"  whole / shard per round: {paired.ratio:.2f}x {interval}: the shard is {paired.verdict}")


if __name__ == "__main__":
    main()

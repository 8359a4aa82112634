"""A tensor-parallel shard by ``get_slice``, against reading the whole weight and against
safetensors' own ``get_slice``, paired by round.

    python benchmarks/slice_load.py [--rows 16384] [--cols 16384] [--dim 1] [--repeat 7] [--cold]

One bf16 weight of ``rows x cols`` is written to a temporary file; each round reads, in a
rotating order, the whole weight (``get_tensor``, then its shard taken), the first eighth along
``--dim`` (``[:, :cols/8]``, a row-parallel layer's shard, by default; ``[:rows/8]`` with
``--dim 0``) with streamer and the same shard with ``safetensors.safe_open(...).get_slice``,
the file warm in the page cache (or evicted before each read with ``--cold``); each shard is
copied once, as a loader's caller copies it into its parameter (safetensors maps the file: its
slice is a view whose bytes are read only when touched). Reported: each read's median seconds
(streamer's ``bytes_read``), and the paired per-round ratios (other / streamer's shard) with
their bootstrap intervals: above 1, streamer's shard is faster (``streamer_bench.stats``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors
import safetensors.torch
import torch

import streamer
from streamer_bench import pagecache, stats


def eighth(shape: list[int], dim: int) -> tuple[slice, ...]:
    """The first eighth of a 2-d weight along ``dim``: one tensor-parallel rank's shard."""
    return (slice(None),) * dim + (slice(0, shape[dim] // 8),)


def whole(path: Path, dim: int) -> int:
    with streamer.safe_open(path) as handle:
        weight = handle.get_tensor("weight")
        weight[eighth(list(weight.shape), dim)].clone()
        return int(handle.handle.metrics["bytes_read"])


def shard(path: Path, dim: int) -> int:
    with streamer.safe_open(path) as handle:
        weight = handle.get_slice("weight")
        weight[eighth(weight.get_shape(), dim)].clone()
        return int(handle.handle.metrics["bytes_read"])


def safetensors_shard(path: Path, dim: int) -> int:
    with safetensors.safe_open(str(path), framework="pt") as handle:
        weight = handle.get_slice("weight")
        weight[eighth(weight.get_shape(), dim)].clone()
    return 0


READS: dict[str, Callable[[Path, int], int]] = {
    "whole": whole,
    "shard": shard,
    "safetensors shard": safetensors_shard,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=16384)
    parser.add_argument("--dim", type=int, choices=(0, 1), default=1, help="the dim sharded (default 1)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--cold", action="store_true")
    args = parser.parse_args()
    names = list(READS)
    with tempfile.TemporaryDirectory(prefix="slice-load-", dir="/var/tmp") as directory:
        path = Path(directory) / "weight.safetensors"
        weight = torch.randn(args.rows, args.cols).to(torch.bfloat16)
        safetensors.torch.save_file({"weight": weight}, str(path))
        del weight
        seconds: dict[str, dict[int, float]] = {name: {} for name in names}
        read: dict[str, int] = {}
        for round_ in range(args.repeat):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                if args.cold:
                    pagecache.make_cold([path])
                started = time.perf_counter()
                read[name] = READS[name](path, args.dim)
                seconds[name][round_] = time.perf_counter() - started
        state = "cold" if args.cold else "warm"
        print(f"{args.rows}x{args.cols} bf16, eighth of dim {args.dim}, {state}, {args.repeat} rounds")
        for name in names:
            bytes_read = f", bytes_read {read[name]:,}" if read[name] else ""
            print(f"  {name:20} median {statistics.median(seconds[name].values()):.3f} s{bytes_read}")
        ours = seconds["shard"]
        for peer in ("whole", "safetensors shard"):
            paired = stats.compare(ours, seconds[peer])  # per round: peer seconds / our shard's
            interval = f"[{paired.low:.2f}, {paired.high:.2f}]" if paired.low is not None else ""
            print(
                f"  {peer} / shard per round: {paired.ratio:.2f}x {interval}: the shard is {paired.verdict}"
            )


if __name__ == "__main__":
    main()

"""Small files loaded in one process: streamer against safetensors plus a copy, paired by round.

    python benchmarks/small_files.py [--sizes 1.5MiB,16MiB,40MiB] [--repeat 30]
                                     [--memory recycled,fresh] [--cold]

Adapters, tokenizer-sized side files and many-shard checkpoints are made of such files, loaded
one after another by a process that is already running, so what counts is the call's own cost.
For each size a file of 16 float32 tensors is written to ``/var/tmp`` and each round calls, in a
rotating order, ``streamer.load_file``, the same with every run through the engine
(``inline_max_bytes=0``), and ``safetensors.torch.load_file`` followed by a ``clone()`` of every
tensor (safetensors maps the file: its tensors are views of the page cache, read when touched;
the copy is what makes them process memory, as streamer's are). Warm (the file read once
before), or with ``--cold`` evicted from the page cache before every call.

Each size and memory regime runs in a process of its own, since the C library's allocator decides
from what a process freed before whether a load's memory is recycled or freshly faulted in, and
that first touch, not the read, then bounds every loader:

- ``recycled``: glibc's thresholds where a long-running torch process leaves them (memory of up
  to 32 MiB from the heap, kept when freed): a load reuses what the last one freed.
- ``fresh``: every tensor's memory newly mapped (``MALLOC_MMAP_THRESHOLD_=65536``) and faulted in
  page by page, whoever loads it.

Reported: each one's median milliseconds and the per-round ratio (safetensors + copy over
streamer) with its bootstrap interval and verdict (``streamer_bench.stats``): above 1, streamer
is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
import torch

import streamer
from streamer_bench import stats
from streamer_bench.pagecache import make_cold

TENSORS = 16
MEMORY: dict[str, dict[str, str]] = {
    "recycled": {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)},
    "fresh": {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)},
}


def with_streamer(path: Path) -> dict[str, torch.Tensor]:
    return streamer.load_file(path)


def with_streamer_engine(path: Path) -> dict[str, torch.Tensor]:
    """Every run through the engine (``inline_max_bytes=0``): what the inline path saves."""
    return streamer.load_file(path, config=streamer.StreamerConfig(inline_max_bytes=0))


def with_safetensors_and_copy(path: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in safetensors.torch.load_file(path).items()}


LOADERS: dict[str, Callable[[Path], dict[str, torch.Tensor]]] = {
    "streamer": with_streamer,
    "streamer engine": with_streamer_engine,
    "safetensors + copy": with_safetensors_and_copy,
}


def run(path: Path, repeat: int, cold: bool) -> dict[str, dict[int, float]]:
    """Seconds per loader per round, in a rotating order."""
    names = list(LOADERS)
    for name in names:
        LOADERS[name](path)  # warm: the page cache, and each loader's first-call costs
    seconds: dict[str, dict[int, float]] = {name: {} for name in names}
    for round_ in range(repeat):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            if cold:
                make_cold([path])
            started = time.perf_counter()
            loaded = LOADERS[name](path)
            seconds[name][round_] = time.perf_counter() - started
            del loaded
    return seconds


def measure(size: int, directory: Path, repeat: int, cold: bool) -> dict[str, dict[int, float]]:
    """Writes the file of ``size`` bytes and times every loader on it (in this process)."""
    path = directory / f"{size}.safetensors"
    g = torch.Generator().manual_seed(size)
    elements = max(1, size // 4 // TENSORS)
    tensors = {f"t{i}": torch.randn(elements, generator=g) for i in range(TENSORS)}
    safetensors.torch.save_file(tensors, str(path))
    del tensors
    return run(path, repeat, cold)


def in_child(size: int, memory: str, directory: Path, repeat: int, cold: bool) -> dict[str, dict[int, float]]:
    """``measure`` in a process of its own, under the allocator settings of ``memory``."""
    command = [sys.executable, __file__, "--child", str(size), "--directory", str(directory)]
    command += ["--repeat", str(repeat)] + (["--cold"] if cold else [])
    done = subprocess.run(
        command, env={**os.environ, **MEMORY[memory]}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"the {memory} run of {size} bytes failed:\n{done.stderr}")
    raw: dict[str, dict[str, float]] = json.loads(done.stdout)
    return {name: {int(r): s for r, s in rounds.items()} for name, rounds in raw.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1.5MiB,16MiB,40MiB", help="file sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument(
        "--memory", default="recycled,fresh", help=f"allocator regimes, comma-separated: {', '.join(MEMORY)}"
    )
    parser.add_argument("--cold", action="store_true", help="evict the file before every call")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--directory", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child, args.directory, args.repeat, args.cold)))
        return
    regimes = [name.strip() for name in args.memory.split(",")]
    unknown = [name for name in regimes if name not in MEMORY]
    if unknown:
        raise SystemExit(f"--memory: unknown regime(s) {', '.join(unknown)} (one of {', '.join(MEMORY)})")
    state = "cold (evicted before every call)" if args.cold else "warm"
    print(
        f"{state}, one process per size and memory regime, {args.repeat} rounds; "
        "ratios per round, other / streamer (>1: streamer faster)"
    )
    columns = f"{'size':>8} {'memory':>9} {'streamer':>10} {'engine':>10} {'st + copy':>10}"
    print(f"{columns}  st + copy / streamer   engine / streamer")
    with tempfile.TemporaryDirectory(prefix="small-files-", dir="/var/tmp") as directory:
        for text in args.sizes.split(","):
            for memory in regimes:
                seconds = in_child(_size(text), memory, Path(directory), args.repeat, args.cold)
                ours = seconds["streamer"]
                medians = " ".join(
                    f"{1e3 * statistics.median(seconds[name].values()):8.2f}ms"
                    for name in ("streamer", "streamer engine", "safetensors + copy")
                )
                verdicts = "  ".join(
                    _verdict(ours, seconds[name]) for name in ("safetensors + copy", "streamer engine")
                )
                print(f"{text:>8} {memory:>9} {medians}  {verdicts}", flush=True)


def _verdict(ours: dict[int, float], theirs: dict[int, float]) -> str:
    paired = stats.compare(ours, theirs)
    interval = f"[{paired.low:.2f}, {paired.high:.2f}]" if paired.low is not None else ""
    return f"{paired.ratio:.2f}x {interval} {paired.verdict}"


def _size(text: str) -> int:
    """A size such as ``1.5MiB`` (binary units; a fraction of a unit allowed)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if match is None:
        raise SystemExit(f"--sizes: cannot read {text!r} as a size (like 1.5MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


if __name__ == "__main__":
    main()

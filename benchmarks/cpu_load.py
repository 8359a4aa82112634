#!/usr/bin/env python3
"""Issue 2's performance check: a 4 GiB bf16 Llama-like checkpoint in 2 shards, loaded into
CPU memory the process owns, cold (evicted and verified) and warm, 3 interleaved repetitions,
streamer at its defaults against Run:ai (concurrency 1..16 x both FS strategies) and
safetensors (mmap + copy, and pread), with fio / memcpy / first-touch ceilings.

    python benchmarks/cpu_load.py                      # the configuration, as filed
    python benchmarks/cpu_load.py --keep /var/tmp/ck   # reuse the generated checkpoint next time
    python benchmarks/cpu_load.py --json out.json --plot out.png

Extra arguments are passed to ``streamer-bench`` after the configuration's own, so a later one
overrides (``--repeat 5``). Takes about 20 minutes on a 2-core VM: every run is a fresh
process (~4 s of interpreter and torch start-up before the clock), and the plan is 20 settings
(streamer 6, Run:ai 12, safetensors 2) x 3 repetitions x 2 cache states.
"""

from __future__ import annotations

import sys

from streamer_bench.cli import main

ISSUE_2 = [
    "--synthetic", "4GiB",
    "--shards", "2",
    "--cold", "--warm",
    "--repeat", "3",
    "--sweep", "concurrency=1,2,4,8,16",
    "--loaders", "streamer,safetensors,runai",
]  # fmt: skip

if __name__ == "__main__":
    raise SystemExit(main([*ISSUE_2, *sys.argv[1:]]))

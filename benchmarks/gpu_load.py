#!/usr/bin/env python3
"""Issue 3's performance check: storage -> pinned ring -> GPU, on a machine with CUDA.

A 16 GiB bf16 Llama-like checkpoint in 4 shards, loaded onto cuda:0, cold (evicted and
verified) and warm, 3 interleaved repetitions: streamer at its defaults (1 GiB pinned ring)
and with concurrency 4..16, against safetensors ``load_file(device="cuda:0")``, Run:ai 0.17
(+ ``.to("cuda")``), InstantTensor and fastsafetensors where installed, with the pinned
host-to-device ceiling of that GPU (``h2d_pinned``) and the storage read ceilings.

    python benchmarks/gpu_load.py --keep /var/tmp/ck          # as filed; keeps the checkpoint
    python benchmarks/gpu_load.py --json gpu.json --plot gpu.png

Extra arguments go to ``streamer-bench`` after these, so a later one overrides
(``--synthetic 4GiB`` for a quick look). Needs torch with CUDA and 40+ GiB of free disk
(the checkpoint, plus tensorizer is left out). Goals (issue 3): warm >= 0.8 x h2d_pinned;
cold >= 0.9 x min(read ceiling, h2d_pinned); >= 2x Run:ai; at least on par with InstantTensor.
"""

from __future__ import annotations

import sys

from streamer_bench.cli import main

ISSUE_3 = [
    "--synthetic", "16GiB",
    "--shards", "4",
    "--device", "cuda:0",
    "--cold", "--warm",
    "--repeat", "3",
    "--sweep", "concurrency=4,8,16",
    "--loaders", "streamer,safetensors,runai,instanttensor,fastsafetensors",
]  # fmt: skip

if __name__ == "__main__":
    raise SystemExit(main([*ISSUE_3, *sys.argv[1:]]))

#!/usr/bin/env python3
"""The S3 comparison as a preset of ``streamer-bench``: a generated Llama-like bf16 checkpoint
uploaded to a local S3 store, then loaded from it into CPU memory the process owns, through:

  - "shaped":   nginx in front of nanio, 20 ms per request + 25 MiB/s per connection (S3-like:
                throughput grows with connections), GETs served from nanio's files;
  - "unshaped": the same nginx without delay or cap (the client's CPU is the limit on 2 cores).

Per endpoint, one ``streamer-bench --synthetic SIZE --upload s3://bench/... --sweep
concurrency=...`` run: streamer, Run:ai (runai-model-streamer-s3, path addressing), boto3
download + safetensors, and plain boto3 ranged GETs (the ceiling) at each concurrency, every run
in a fresh process, rounds interleaved, and the paired per-round verdicts of streamer's default
against each peer at its best. ``--clock process`` puts interpreter start and imports inside the
clock too (a server's cold start).

    python benchmarks/s3_load.py --start-servers --keep /var/tmp/s3ck --json /tmp/s3  # stops them at the end
    python benchmarks/s3_load.py --endpoints shaped --size 4GiB --repeat 5 --clock process

Needs: pip install runai-model-streamer-s3==0.17.* boto3; nginx with the lua module
(``../shared/s3/s3_server.sh`` installs it). Loopback only. ``--json PREFIX`` writes
``PREFIX-<endpoint>.json`` per endpoint (``benchmarks/streamer_bench/schema.json``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

BUCKET = "bench"
ENDPOINTS = {"shaped": "http://127.0.0.1:9100", "unshaped": "http://127.0.0.1:9101"}
KEY_ID, SECRET = "testing", "testing12345"  # what s3_server.sh's nanio accepts by default


def _servers() -> list[tuple[str, dict[str, str]]]:
    """``s3_server.sh``'s server name and environment for nanio, the shaped and the unshaped endpoint."""
    base = dict(os.environ, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET)
    run = base.get("S3_RUN_DIR", "/tmp/s3-local")
    data = f"{run}/nanio-data"
    shaped = dict(base, S3_RUN_DIR=run, S3_STATIC_ROOT=data, S3_DELAY_MS="20", S3_RATE="25m")
    plain = dict(base, S3_RUN_DIR=run + "-unshaped", S3_PORT="9101", S3_STATIC_ROOT=data)
    return [
        ("nanio", dict(base, S3_RUN_DIR=run)),
        ("shaper", shaped),
        ("shaper", dict(plain, S3_DELAY_MS="0", S3_RATE="0")),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--concurrency", default="4,16,32,64", help="swept for every loader that has it ('': defaults only)"
    )
    parser.add_argument("--endpoints", default="shaped,unshaped")
    parser.add_argument("--loaders", default="streamer,runai,safetensors,boto3")
    parser.add_argument("--clock", choices=("load", "process"), default="load")
    parser.add_argument("--keep", type=Path, help="generate the checkpoint here (reused next time)")
    parser.add_argument(
        "--start-servers",
        action="store_true",
        help="start nanio and both endpoints (--s3-tools' s3_server.sh) first, and stop them at the end",
    )
    tools = Path(__file__).resolve().parents[2] / "shared" / "s3"
    parser.add_argument("--s3-tools", type=Path, default=tools)
    parser.add_argument("--json", type=Path, help="PREFIX: write PREFIX-<endpoint>.json per endpoint")
    parser.add_argument("--baseline", metavar="PYTHON", help="streamer-bench --baseline: A/B another install")
    args = parser.parse_args(argv)
    script = str(args.s3_tools / "s3_server.sh")
    started: list[tuple[str, dict[str, str]]] = []
    try:
        for server, env in _servers() if args.start_servers else []:
            subprocess.run(["bash", script, "start", server], env=env, check=True)
            started.append((server, env))
        return _bench(args)
    finally:  # what --start-servers started is stopped, whatever happened
        for server, env in reversed(started):
            subprocess.run(["bash", script, "stop", server], env=env, check=False)


def _bench(args: argparse.Namespace) -> int:
    """One streamer-bench run per endpoint; nonzero if any failed."""
    status = 0
    for name in [e for e in args.endpoints.split(",") if e]:
        command = [
            sys.executable, "-m", "streamer_bench",
            "--synthetic", args.size,
            "--shards", str(args.shards),
            "--upload", f"s3://{BUCKET}/ckpt-{args.size}-{args.shards}/",
            "--repeat", str(args.repeat),
            "--loaders", args.loaders,
            "--clock", args.clock,
        ]  # fmt: skip
        if args.concurrency:
            command += ["--sweep", f"concurrency={args.concurrency}"]
        if args.baseline is not None:
            command += ["--baseline", args.baseline]
        if args.keep is not None:
            command += ["--keep", str(args.keep)]
        if args.json is not None:
            command += ["--json", f"{args.json}-{name}.json"]
        env = dict(
            os.environ,
            AWS_ENDPOINT_URL=ENDPOINTS[name],
            AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", KEY_ID),
            AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET),
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
            STREAMER_S3_ADDRESSING_STYLE="path",
            RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        )
        print(f"== {name} endpoint {ENDPOINTS[name]}: {' '.join(command[1:])}", flush=True)
        status |= subprocess.run(command, env=env).returncode
    return status


if __name__ == "__main__":
    raise SystemExit(main())

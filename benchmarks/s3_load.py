#!/usr/bin/env python3
"""Issue 4's performance check: a generated Llama-like bf16 checkpoint (1 GiB, 2 shards) loaded
from S3 into CPU memory the process owns, through a local S3 store:

  - "shaped":   nginx in front of nanio, 20 ms per request + 25 MiB/s per connection (S3-like:
                throughput grows with connections), GETs served from nanio's files;
  - "unshaped": the same nginx without delay or cap (the client's CPU is the limit on 2 cores).

Loaders, each in a fresh process, interleaved (A B C ... A B C ...), medians of --repeat runs:

  - streamer at its defaults (streamer.load of the index URI);
  - Run:ai model streamer (runai-model-streamer-s3) at RUNAI_STREAMER_CONCURRENCY 4..64;
  - plain boto3 ranged GETs (--range-mib, default 16 MiB) on as many threads / connections as
    streamer's default S3 concurrency, bodies copied into freshly allocated memory (the ceiling
    of the link at those connections);
  - boto3 download_file of every shard to local disk, then safetensors load_file (+ copy into
    owned memory).

Every timed region starts after the loader's Python package is imported and ends when every
tensor's bytes sit in memory the process owns; clients, sessions and header reads are inside.

    bash ../shared/s3/s3_server.sh ...           # or --start-servers (nanio, two nginx shapers)
    python benchmarks/s3_load.py --start-servers --keep /var/tmp/s3ck --json /tmp/s3.json

Needs: pip install runai-model-streamer-s3==0.17.* boto3; nginx with the lua module (the server
script installs it). Loopback only. Takes ~5 minutes on a 2-core VM with --repeat 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUCKET = "bench"
STORE = "http://127.0.0.1:9000"  # nanio (uploads)
ENDPOINTS = {"shaped": "http://127.0.0.1:9100", "unshaped": "http://127.0.0.1:9101"}
KEY_ID, SECRET = "testing", "testing12345"  # what s3_server.sh's nanio accepts by default
MiB = 1 << 20


# --- child: one timed load ------------------------------------------------------------------------


def _child(request: dict[str, Any]) -> dict[str, Any]:
    loader, endpoint, uris = request["loader"], request["endpoint"], request["uris"]
    if loader == "streamer":
        import streamer

        config = streamer.StreamerConfig(
            s3=streamer.S3Config(endpoint_url=endpoint, addressing_style="path", region="us-east-1")
        )
        start = time.perf_counter()
        # streamer.load(), spelled out to time the start (lazy imports of aiobotocore / aiohttp /
        # botocore, the client, listing and header reads) apart from reading the tensors
        with streamer.open(request["index_uri"], config=config) as handle:
            opened = time.perf_counter() - start
            tensors = dict(handle._iterate(keep_all=True))
        seconds = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"seconds": seconds, "bytes": nbytes, "open_s": opened, "read_s": seconds - opened}
    elif loader == "runai":
        from runai_model_streamer import SafetensorsStreamer

        start = time.perf_counter()
        tensors = {}
        with SafetensorsStreamer() as runai:
            runai.stream_files(uris)
            for name, tensor in runai.get_tensors():
                tensors[name] = tensor  # owned tensors in 0.17 (its default owned=True)
        seconds = time.perf_counter() - start
    elif loader == "boto3":
        import boto3

        from streamer.bench import s3peers

        connections, range_bytes = request["connections"], request["range_mib"] * MiB
        start = time.perf_counter()
        buffers = s3peers.ranged_get(_client(endpoint, connections), uris, connections, range_bytes)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "bytes": sum(len(b) for b in buffers)}
    elif loader == "download":
        import boto3  # noqa: F401
        import safetensors.torch

        from streamer.bench import s3peers

        with tempfile.TemporaryDirectory(dir=request.get("tmp")) as directory:
            start = time.perf_counter()
            tensors = {}
            for path in s3peers.download(_client(endpoint, 10), uris, Path(directory)):
                # load_file gives views of a file mapping: copy them into owned memory
                tensors.update({k: v.clone() for k, v in safetensors.torch.load_file(path).items()})
            seconds = time.perf_counter() - start
    else:
        raise SystemExit(f"unknown loader {loader}")
    return {"seconds": seconds, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def _client(endpoint: str, pool: int) -> Any:
    from streamer.bench import s3peers
    from streamer.config import S3Config

    config = S3Config(endpoint_url=endpoint, addressing_style="path", region="us-east-1")
    return s3peers.client(config, pool)


# --- parent ---------------------------------------------------------------------------------------


def _start_servers(tools: Path) -> None:
    script = str(tools / "s3_server.sh")
    base = dict(os.environ, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET)
    run = base.get("S3_RUN_DIR", "/tmp/s3-local")
    data = f"{run}/nanio-data"
    subprocess.run(["bash", script, "start", "nanio"], env=dict(base, S3_RUN_DIR=run), check=True)
    shaped = dict(base, S3_RUN_DIR=run, S3_STATIC_ROOT=data, S3_DELAY_MS="20", S3_RATE="25m")
    subprocess.run(["bash", script, "start", "shaper"], env=shaped, check=True)
    plain = dict(base, S3_RUN_DIR=run + "-unshaped", S3_PORT="9101", S3_STATIC_ROOT=data)
    subprocess.run(
        ["bash", script, "start", "shaper"], env=dict(plain, S3_DELAY_MS="0", S3_RATE="0"), check=True
    )


def _upload(directory: Path, files: list[Path], index: Path, prefix: str) -> None:
    client = _client(STORE, 10)
    try:
        client.head_bucket(Bucket=BUCKET)
    except Exception:
        client.create_bucket(Bucket=BUCKET)
    from boto3.s3.transfer import TransferConfig

    for path in [*files, index]:
        key = f"{prefix}/{path.name}"
        try:
            if client.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == path.stat().st_size:
                continue
        except Exception:
            pass
        client.upload_file(str(path), BUCKET, key, Config=TransferConfig(multipart_chunksize=64 * MiB))


def _run_child(request: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(request)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runai-concurrency", default="4,8,16,32,64")
    parser.add_argument("--range-mib", type=int, default=16, help="boto3 ranged GET size")
    parser.add_argument("--endpoints", default="shaped,unshaped")
    parser.add_argument("--keep", type=Path, help="generate the checkpoint here (reused next time)")
    parser.add_argument("--start-servers", action="store_true")
    parser.add_argument(
        "--s3-tools", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "s3"
    )
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0

    from streamer.bench.synthetic import generate
    from streamer.config import S3Config, parse_size

    if args.start_servers:
        _start_servers(args.s3_tools)
    size = parse_size(args.size, name="--size")
    directory = args.keep or Path(tempfile.mkdtemp(prefix="s3-bench-"))
    synthetic = generate(directory, size, args.shards)
    prefix = f"ckpt-{size >> 20}m-{args.shards}"
    os.environ.setdefault("AWS_ACCESS_KEY_ID", KEY_ID)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET)
    _upload(directory, synthetic.files, synthetic.index, prefix)
    uris = [f"s3://{BUCKET}/{prefix}/{f.name}" for f in synthetic.files]
    connections = S3Config().concurrency
    settings: list[tuple[str, dict[str, Any], dict[str, str]]] = [("streamer", {}, {})]
    for c in [int(c) for c in args.runai_concurrency.split(",") if c]:
        settings.append(("runai", {"concurrency": c}, {"RUNAI_STREAMER_CONCURRENCY": str(c)}))
    settings.append(("boto3", {"connections": connections, "range_mib": args.range_mib}, {}))
    settings.append(("download", {}, {}))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMER_", "RUNAI_STREAMER_"))}
    base_env.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="us-east-1",
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
    )
    runs: list[dict[str, Any]] = []
    endpoints = [e for e in args.endpoints.split(",") if e]
    print(
        f"checkpoint: {synthetic.tensor_bytes / 1e9:.2f} GB of tensors in {len(uris)} shards; "
        f"streamer S3 concurrency {connections}",
        flush=True,
    )
    for repeat in range(args.repeat):
        for endpoint_name in endpoints:
            endpoint = ENDPOINTS[endpoint_name]
            for loader, knobs, env in settings:
                request = {
                    "loader": loader,
                    "endpoint": endpoint,
                    "uris": uris,
                    "index_uri": f"s3://{BUCKET}/{prefix}/{synthetic.index.name}",
                    **knobs,
                }
                result = _run_child(request, dict(base_env, AWS_ENDPOINT_URL=endpoint, **env))
                label = loader + "".join(f" {k}={v}" for k, v in knobs.items() if k != "range_mib")
                row = {
                    "repeat": repeat,
                    "endpoint": endpoint_name,
                    "loader": loader,
                    "setting": label,
                    **result,
                }
                if "seconds" in result:
                    row["gb_per_s"] = result["bytes"] / result["seconds"] / 1e9
                runs.append(row)
                shown = f"{row['gb_per_s']:.3f} GB/s" if "gb_per_s" in row else f"ERROR {result.get('error')}"
                if "open_s" in result:
                    rate = result["bytes"] / result["read_s"] / 1e9
                    shown += f"  (start {result['open_s']:.2f} s, then {rate:.3f} GB/s)"
                print(f"[{repeat}] {endpoint_name:9s} {label:28s} {shown}", flush=True)
    summary = _summarize(runs, endpoints)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    return 0


def _summarize(runs: list[dict[str, Any]], endpoints: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for endpoint in endpoints:
        medians: dict[str, tuple[float, float, float]] = {}
        for label in dict.fromkeys(r["setting"] for r in runs if r["endpoint"] == endpoint):
            rates = [
                r["gb_per_s"]
                for r in runs
                if r["endpoint"] == endpoint and r["setting"] == label and "gb_per_s" in r
            ]
            if rates:
                medians[label] = (statistics.median(rates), min(rates), max(rates))
        print(f"\n== {endpoint}: median GB/s (min-max) over the repeats")
        for label, (med, lo, hi) in medians.items():
            print(f"  {label:30s} {med:6.3f}  ({lo:.3f}-{hi:.3f})")
        ours = medians.get("streamer", (0.0, 0.0, 0.0))[0]
        runai = {k: v[0] for k, v in medians.items() if k.startswith("runai")}
        best_runai = max(runai.items(), key=lambda kv: kv[1]) if runai else None
        boto3 = next((v[0] for k, v in medians.items() if k.startswith("boto3")), None)
        download = medians.get("download", (None,))[0]
        ratios = {
            "vs_runai_best": ours / best_runai[1] if best_runai else None,
            "runai_best_setting": best_runai[0] if best_runai else None,
            "vs_boto3_same_connections": ours / boto3 if boto3 else None,
            "vs_download_then_load": ours / download if download else None,
        }
        print(
            "  ratios: streamer / Run:ai best = {}, / boto3 = {}, / download+load = {}".format(
                *(
                    f"{v:.2f}" if isinstance(v, float) else "n/a"
                    for v in (
                        ratios["vs_runai_best"],
                        ratios["vs_boto3_same_connections"],
                        ratios["vs_download_then_load"],
                    )
                )
            )
        )
        summary[endpoint] = {"medians": medians, "ratios": ratios}
    return summary


if __name__ == "__main__":
    raise SystemExit(main())

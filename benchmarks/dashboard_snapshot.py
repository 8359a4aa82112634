"""The Grafana dashboard's panels (``docs/grafana/streamer-loads.json``), drawn with matplotlib from
the metrics of a real run, for the README: Grafana is not needed to see what it shows.

    python benchmarks/dashboard_snapshot.py [--size 256MiB] [--out docs/grafana/streamer-loads.png]

One process with ``StreamerConfig(metrics=True)`` loads a generated checkpoint: from local files
warm and cold (page cache evicted and verified), from S3 (a moto server on 127.0.0.1) through a
node cache (the first load misses, the next ones hit), and a few loads that fail (a missing file,
a file cut short). After each load the ``streamer_*`` series are read from the registry, as a
scrape would, and each panel is drawn from those samples against the load number.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import contextlib

import matplotlib.pyplot as plt
import safetensors.torch
import torch

import streamer
from streamer.config import CacheConfig, S3Config
from streamer.config.fields import parse_size
from streamer.metrics import REGISTRY
from streamer_bench import pagecache

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape() -> Scrape:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
    }


def total(samples: Scrape, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (PromQL's ``sum``)."""
    return sum(
        value
        for (sample, have), value in samples.items()
        if sample == name and all((k, v) in have for k, v in labels.items())
    )


def write_checkpoint(directory: Path, size: int) -> None:
    g = torch.Generator().manual_seed(7)
    for shard in range(2):
        tensors = {f"layers.{shard}.{i}.weight": torch.randn(size // 4 // 16, generator=g) for i in range(8)}
        safetensors.torch.save_file(tensors, str(directory / f"model-0000{shard + 1}-of-00002.safetensors"))


def run(directory: Path, work: Path) -> list[tuple[str, Scrape]]:
    """The loads, each with the scrape taken after it."""
    from moto.server import ThreadedMotoServer

    files = sorted(directory.glob("*.safetensors"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        import boto3

        s3 = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id="demo", aws_secret_access_key="demo",
        )  # fmt: skip
        s3.create_bucket(Bucket="models")
        for path in files:
            s3.upload_file(str(path), "models", f"llama/{path.name}")
        credentials = S3Config(
            endpoint_url=endpoint, region="us-east-1", access_key_id="demo", secret_access_key="demo",
            addressing_style="path",
        )  # fmt: skip
        local = streamer.StreamerConfig(metrics=True)
        remote = streamer.StreamerConfig(
            metrics=True, s3=credentials, cache=CacheConfig(dir=str(work / "cache"))
        )
        cut = work / "cut.safetensors"
        cut.write_bytes(files[0].read_bytes()[: files[0].stat().st_size // 2])

        def failing(source: Path) -> Callable[[], Any]:
            def load() -> None:
                with contextlib.suppress(streamer.StreamerError):
                    streamer.load(source, config=local)

            return load

        def cold() -> None:
            pagecache.make_cold(files)
            streamer.load(directory, config=local)

        def warm() -> None:
            pagecache.make_warm(files)
            streamer.load(directory, config=local)

        steps: list[tuple[str, Callable[[], Any]]] = [("warm", warm)] * 4
        steps += [("cold", cold)] * 3
        steps += [("s3", lambda: streamer.load("s3://models/llama/", config=remote))] * 4
        steps += [("error", failing(work / "missing.safetensors")), ("error", failing(cut))]
        steps += [("warm", warm)] * 2
        scrapes = []
        for what, step in steps:
            step()
            scrapes.append((what, scrape()))
        return scrapes
    finally:
        server.stop()


def draw(scrapes: list[tuple[str, Scrape]], out: Path) -> None:
    loads = list(range(1, len(scrapes) + 1))
    previous: list[Scrape] = [{}] + [samples for _, samples in scrapes[:-1]]

    def per_load(name: str, **labels: str) -> list[float]:
        return [
            total(now, name, **labels) - total(before, name, **labels)
            for (_, now), before in zip(scrapes, previous, strict=True)
        ]

    figure, axes = plt.subplots(3, 2, figsize=(13, 10.5))
    figure.suptitle("streamer: model weight loads (docs/grafana/streamer-loads.json, drawn from a real run)")
    seconds = per_load("streamer_load_seconds_sum")
    gbps = [
        b / s / 1e9 if s else 0.0
        for b, s in zip(per_load("streamer_loaded_bytes_total"), seconds, strict=True)
    ]
    for scheme in ("file", "s3"):
        ran = per_load("streamer_load_seconds_count", scheme=scheme, result="ok")
        xs = [x for x, n in zip(loads, ran, strict=True) if n]
        axes[0][0].plot(xs, [seconds[x - 1] for x in xs], "o-", label=scheme)
        axes[0][1].plot(xs, [gbps[x - 1] for x in xs], "o-", label=scheme)
    axes[0][0].set(title="Cold-start seconds (each load)", ylabel="s")
    axes[0][1].set(title="GB/s (each load)", ylabel="GB/s")
    bottom = [0.0] * len(loads)
    for origin in ("storage", "cache_miss", "cache_hit"):
        heights = [b / 1e9 for b in per_load("streamer_read_bytes_total", origin=origin)]
        axes[1][0].bar(loads, heights, bottom=bottom, label=origin)
        bottom = [low + high for low, high in zip(bottom, heights, strict=True)]
    axes[1][0].set(title="Bytes read, by origin", ylabel="GB")
    hits = [total(s, "streamer_read_bytes_total", origin="cache_hit") for _, s in scrapes]
    misses = [total(s, "streamer_read_bytes_total", origin="cache_miss") for _, s in scrapes]
    ratio = [hit / (hit + miss) if hit + miss else 0.0 for hit, miss in zip(hits, misses, strict=True)]
    axes[1][1].plot(loads, ratio, "o-")
    axes[1][1].set(title="Node-cache hit ratio (cumulative)", ylim=(0, 1.05))
    for name, label in (("streamer_requests_total", "requests"), ("streamer_retries_total", "retries"),
                        ("streamer_throttles_total", "throttled")):  # fmt: skip
        axes[2][0].plot(loads, [total(s, name, scheme="s3") for _, s in scrapes], "o-", label=f"{label} s3")
    axes[2][0].set(title="Requests, retries and throttling by storage (cumulative)", xlabel="load")
    errors = sorted(
        {dict(k[1])["error"] for _, s in scrapes for k in s if k[0] == "streamer_loads_total"} - {""}
    )
    for error in errors:
        axes[2][1].plot(
            loads, [total(s, "streamer_loads_total", error=error) for _, s in scrapes], "o-", label=error
        )
    ok = [total(s, "streamer_loads_total", result="ok") for _, s in scrapes]
    axes[2][1].plot(loads, ok, "o-", label="ok")
    axes[2][1].set(title="Loads by result and error type (cumulative)", xlabel="load")
    for row in axes:
        for axis in row:
            if axis.get_legend_handles_labels()[1]:
                axis.legend(fontsize=8)
            axis.grid(alpha=0.3)
    for index, (what, _) in enumerate(scrapes):
        axes[0][0].annotate(what, (loads[index], 0), fontsize=6, rotation=90, xytext=(0, 2),
                            textcoords="offset points", xycoords=("data", "axes fraction"))  # fmt: skip
    figure.tight_layout()
    figure.savefig(out, dpi=90)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--size", default="256MiB", help="checkpoint size (default 256MiB)")
    parser.add_argument("--out", type=Path, default=Path("docs/grafana/streamer-loads.png"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dashboard-", dir="/var/tmp") as tmp:
        directory = Path(tmp) / "llama"
        directory.mkdir()
        write_checkpoint(directory, parse_size(args.size, name="--size"))
        os.sync()
        scrapes = run(directory, Path(tmp))
    draw(scrapes, args.out)
    print(f"wrote {args.out} ({len(scrapes)} loads)")


if __name__ == "__main__":
    main()

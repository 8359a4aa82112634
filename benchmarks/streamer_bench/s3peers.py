"""Plain boto3 reads of S3 checkpoints, the references streamer is measured against, and the
upload of a generated checkpoint (all for ``streamer-bench``):

- ``ranged_get``: every byte of every object by ranged GETs on N connections into fresh
  anonymous memory, the ceiling of the endpoint at that concurrency;
- ``download``: boto3's managed download of each object to a local file, what people do before
  ``safetensors.torch.load_file``;
- ``upload``: local files to a prefix (``--synthetic … --upload s3://bucket/prefix/``).

Clients are built from streamer's ``S3Config`` (itself defaulting to the standard AWS variables),
so every reader goes to the same endpoint, region and addressing style.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamer.backends.s3.uri import parse_uri
from streamer.config import S3Config
from streamer_bench.parallel import on_threads

MiB = 1 << 20
RANGE_BYTES = 16 * MiB  # per GET; large enough that request latency is not the limit


def client(config: S3Config, connections: int) -> Any:
    """A boto3 S3 client with a pool for ``connections`` threads; no retries (a reference figure
    must not hide failures) and no response checksums (streamer does not compute them either)."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=config.endpoint_url,
        region_name=config.region,
        verify=(config.ca_bundle or True) if config.verify else False,
        config=Config(
            max_pool_connections=max(connections, 10),
            s3={"addressing_style": config.addressing_style},
            retries={"total_max_attempts": 1},
            response_checksum_validation="when_required",
            signature_version=UNSIGNED if config.anonymous else None,
        ),
    )


def ranged_get(
    s3: Any, uris: Sequence[str], connections: int, range_bytes: int = RANGE_BYTES
) -> list[mmap.mmap]:
    """Every object read into its own fresh MAP_PRIVATE anonymous buffer by ranged GETs on
    ``connections`` threads; the sizes come from HEAD requests, as a reader without streamer's
    header reads would get them."""
    jobs: list[tuple[memoryview, str, str, int, int]] = []
    buffers = []
    for uri in uris:
        where = parse_uri(uri)
        size = int(s3.head_object(Bucket=where.bucket, Key=where.key)["ContentLength"])
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffers.append(buffer)
        view = memoryview(buffer)
        jobs += [
            (view, where.bucket, where.key, begin, min(begin + range_bytes, size))
            for begin in range(0, size, range_bytes)
        ]

    def work(job: tuple[memoryview, str, str, int, int]) -> None:
        view, bucket, key, begin, end = job
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={begin}-{end - 1}")["Body"]
        position = begin
        while position < end:
            chunk = body.read(min(MiB, end - position))
            if not chunk:
                raise OSError(f"s3://{bucket}/{key}: body ended at byte {position} of {end}")
            view[position : position + len(chunk)] = chunk
            position += len(chunk)

    on_threads(jobs, work, connections)
    return buffers


def download(s3: Any, uris: Sequence[str], directory: Path) -> list[Path]:
    """Each object to ``directory`` under its base name, one after another (boto3 splits large
    objects over its own threads)."""
    paths = []
    for uri in uris:
        where = parse_uri(uri)
        path = directory / os.path.basename(where.key)
        s3.download_file(where.bucket, where.key, str(path))
        paths.append(path)
    return paths


def upload(s3: Any, files: Sequence[Path], prefix: str) -> list[str]:
    """Puts ``files`` under the ``s3://bucket/prefix/`` URI (making the bucket if it is missing);
    an object already there with the same size is kept. Returns the objects' URIs, in order."""
    from boto3.s3.transfer import TransferConfig

    where = parse_uri(prefix if prefix.endswith("/") else prefix + "/")
    try:
        s3.head_bucket(Bucket=where.bucket)
    except Exception:  # missing (or not ours to look at): creating it says which
        s3.create_bucket(Bucket=where.bucket)
    uris = []
    for path in files:
        key = where.key + path.name
        uris.append(f"s3://{where.bucket}/{key}")
        try:
            if s3.head_object(Bucket=where.bucket, Key=key)["ContentLength"] == path.stat().st_size:
                continue
        except Exception:  # not there yet
            pass
        s3.upload_file(str(path), where.bucket, key, Config=TransferConfig(multipart_chunksize=64 * MiB))
    return uris

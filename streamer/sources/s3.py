"""S3 sources: ``s3://bucket/key.safetensors``, ``s3://bucket/prefix/`` and ``s3://bucket/.../*.index.json``.

Resolving lists the prefix or reads the index; then every file's header is fetched, all files at
once, each with one speculative ranged GET of the first ``header_bytes`` (which also gives the
object's size and ETag) and a second GET only when the header is longer. The headers are parsed
by the same strict format layer as local files; ``FileHeader.path`` is the object's URI.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from streamer.backends.s3 import ClientHolder, ObjectInfo, S3Client, S3Uri, parse_uri
from streamer.config import S3Config
from streamer.errors import S3SourceError, SourceError
from streamer.format.safetensors import PREFIX_BYTES, FileHeader, header_length, parse_header
from streamer.sources.local import INDEX_SUFFIX, ResolvedSource, parse_index

_SUFFIX = ".safetensors"
_HEADER_REQUESTS = 32  # header GETs in flight at once


def open_s3(
    sources: Sequence[str], config: S3Config
) -> tuple[ResolvedSource, tuple[FileHeader, ...], tuple[ObjectInfo, ...], ClientHolder]:
    """Resolves the URIs (one URI, or a list of object URIs) and reads every header.

    Returns the client holder too, still open: the checkpoint's runs reuse its client (making
    one costs ~0.1 s); the caller closes it.
    """
    uris = [parse_uri(s) for s in sources]
    holder = ClientHolder(config)
    try:
        client = holder.get()
        resolved, headers, objects = client.call(_open(client, uris, single=len(sources) == 1))
    except BaseException:
        holder.close()
        raise
    return resolved, headers, objects, holder


async def _open(
    client: S3Client, uris: list[S3Uri], *, single: bool
) -> tuple[ResolvedSource, tuple[FileHeader, ...], tuple[ObjectInfo, ...]]:
    index_path: str | None = None
    weight_map: dict[str, str] = {}
    if single and (uris[0].key == "" or uris[0].key.endswith("/")):
        files = await _list_prefix(client, uris[0])
    elif single and uris[0].key.endswith(INDEX_SUFFIX):
        index = uris[0]
        index_path = str(index)
        names = parse_index(await client.get_object(index), path=index_path)
        directory = index.key.rpartition("/")[0]
        prefix = f"{directory}/" if directory else ""
        shards = sorted(set(names.values()))
        files = [S3Uri(index.bucket, prefix + shard) for shard in shards]
        weight_map = {name: str(S3Uri(index.bucket, prefix + shard)) for name, shard in names.items()}
    else:
        if len({str(u) for u in uris}) != len(uris):
            raise SourceError("the list of checkpoint files names a file twice")
        for uri in uris:
            if uri.key == "" or uri.key.endswith("/"):
                raise SourceError("a list of checkpoint files must name objects, not prefixes", path=str(uri))
        files = uris
    gate = asyncio.Semaphore(_HEADER_REQUESTS)

    async def header(uri: S3Uri) -> tuple[FileHeader, ObjectInfo]:
        async with gate:
            return await _read_header(client, uri)

    try:
        results = await asyncio.gather(*(header(u) for u in files))
    except S3SourceError as error:
        if index_path is not None:
            raise S3SourceError(
                f"the index references a missing or forbidden shard {error.key!r}: {error.reason}",
                bucket=error.bucket,
                key=error.key,
                status=error.status,
                code=error.code,
                attempts=error.attempts,
            ) from None
        if single and error.status == 404 and error.code != "NoSuchBucket":
            # s3://bucket/dir without the slash: a prefix, if it holds safetensors files.
            listed = await _maybe_prefix(client, files[0])
            if listed:
                return await _open(client, [S3Uri(files[0].bucket, files[0].key + "/")], single=True)
        raise
    resolved = ResolvedSource(
        paths=tuple(h.path for h, _ in results), weight_map=weight_map, index_path=index_path
    )
    return resolved, tuple(h for h, _ in results), tuple(i for _, i in results)


async def _list_prefix(client: S3Client, prefix: S3Uri) -> list[S3Uri]:
    keys = [k for k in await client.list_keys(prefix.bucket, prefix.key) if k.endswith(_SUFFIX)]
    if not keys:
        raise S3SourceError(
            "no *.safetensors object directly under this prefix", bucket=prefix.bucket, key=prefix.key
        )
    return [S3Uri(prefix.bucket, k) for k in keys]


async def _maybe_prefix(client: S3Client, uri: S3Uri) -> bool:
    if uri.key.endswith(_SUFFIX) or uri.key.endswith(INDEX_SUFFIX):
        return False
    keys = await client.list_keys(uri.bucket, uri.key + "/")
    return any(k.endswith(_SUFFIX) for k in keys)


async def _read_header(client: S3Client, uri: S3Uri) -> tuple[FileHeader, ObjectInfo]:
    path = str(uri)
    start, info = await client.get_start(uri, client.config.header_bytes)
    n = header_length(start[:PREFIX_BYTES], path=path, file_size=info.size)
    end = PREFIX_BYTES + n
    if len(start) < end:
        start += await client.get_bytes(info, len(start), end, source_errors=True)
    return parse_header(start[PREFIX_BYTES:end], path=path, file_size=info.size), info


def split_sources(source: object) -> list[str] | None:
    """The S3 URIs of ``source`` if it names S3 objects, ``None`` if it names local files.

    A list mixing both is rejected: one checkpoint lives in one place.
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        return [text] if isinstance(text, str) and text.startswith("s3://") else None
    if isinstance(source, (list, tuple)):
        texts = [os.fspath(s) for s in source]
        remote = [isinstance(t, str) and t.startswith("s3://") for t in texts]
        if any(remote) and not all(remote):
            raise SourceError("a checkpoint's files must be all local or all on S3, not a mix")
        if texts and all(remote):
            return [str(t) for t in texts]
    return None

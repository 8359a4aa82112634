"""The one typed configuration object, with environment variables as defaults.

Environment variables are read when a ``StreamerConfig`` is built, never
written: two loaders in one process can use different settings.
"""

from __future__ import annotations

import dataclasses
import functools
import grp
import time
from dataclasses import field
from typing import Literal

from streamer.config.fields import (
    choice,
    count,
    environment_snapshot,
    flag,
    parse_fields,
    seconds,
    setting,
    size,
    text,
    variables,
)
from streamer.errors import ConfigError
from streamer.host.machine import STAGED_READERS, default_readers, hugepages_by_default, usable_cores
from streamer.host.safedir import Access
from streamer.records import record

IoMode = Literal["auto", "buffered", "direct"]
IO_MODES: tuple[IoMode, ...] = ("auto", "buffered", "direct")

DIRECT_IO_ALIGNMENT = 4096
AddressingStyle = Literal["auto", "path", "virtual"]
ADDRESSING_STYLES: tuple[AddressingStyle, ...] = ("auto", "path", "virtual")


_MASK = "***"


def _masked_repr(config: object, secrets: tuple[str, ...]) -> str:
    """A config's fields, each secret that is set shown as ``***``."""
    shown = []
    for name in getattr(config, "__dataclass_fields__", {}):
        value = getattr(config, name)
        shown.append(f"{name}={(_MASK if value is not None else None) if name in secrets else value!r}")
    return f"{type(config).__name__}({', '.join(shown)})"


@record  # its own __repr__ masks the credentials
class S3Config:
    """How S3 sources are read. Unset credentials use boto3's standard chain (environment, shared
    profile, web identity, instance role); explicit ones are never shown by ``repr``.

    concurrency: ranged GETs in flight at once (one connection each).
    endpoint_url: an S3-compatible endpoint (MinIO, Ceph, ...); default ``AWS_ENDPOINT_URL_S3``
        or ``AWS_ENDPOINT_URL``, else AWS.
    addressing_style: ``path`` (``host/bucket/key``), ``virtual`` (``bucket.host/key``) or ``auto``.
    anonymous: unsigned requests (public buckets); no credentials are looked up.
    ca_bundle: a CA bundle for TLS (default ``AWS_CA_BUNDLE``, else botocore's); ``verify=False``
        turns certificate checks off.
    max_attempts: tries per request, the first included; throttling (503 SlowDown, 429), other 5xx,
        connection resets, timeouts and short bodies are retried for the missing bytes only,
        with exponential backoff and full jitter.
    retry_deadline: seconds after a request's first try after which no further try starts.
    min_rate, attempt_allowance: one try for ``n`` bytes (data, header read or listing page) is
        cut after ``attempt_allowance + n / min_rate`` seconds, even while bytes still trickle in.
    low_speed_window, low_speed_tries: a try is also cut (and retried) as soon as any
        ``low_speed_window`` seconds of it moved less than ``min_rate`` bytes per second, as
        curl's low-speed limit does; a request cut so ``low_speed_tries`` times fails. With the
        defaults a server that trickles fails in about 30 s, and a steady link at ``min_rate`` or
        more is never cut.
    load_deadline: seconds a run's S3 reads may take in all; tries in flight are cut at it.
        ``None``: no such bound (each request is still bounded by the two above).
    require_etag: every response must carry the ETag the header read saw. ``False`` accepts
        responses without one (a replaced object may then go unnoticed, if the server also
        ignores ``If-Match``); such a response's bytes count only once it completes.
    max_list_pages: pages a prefix listing may take before it is an error.
    header_bytes: bytes fetched speculatively from the start of each file to read its header
        (a second request only when the header is longer). 256 KiB holds the header of a shard
        of thousands of tensors; what it reads past the header is not used, so 1 MiB cost every
        S3 open ~30 ms more on a 25 MiB/s connection.
    """

    concurrency: int = setting(count(1, 1024), 64, env="STREAMER_S3_CONCURRENCY")
    endpoint_url: str | None = setting(text(), env=("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    region: str | None = setting(text(), env=("AWS_REGION", "AWS_DEFAULT_REGION"))
    addressing_style: AddressingStyle = setting(
        choice(ADDRESSING_STYLES), "auto", env="STREAMER_S3_ADDRESSING_STYLE"
    )
    anonymous: bool = setting(flag(), False, env="STREAMER_S3_ANONYMOUS")
    profile: str | None = setting(text())
    access_key_id: str | None = setting(text(), repr=False)
    secret_access_key: str | None = setting(text(), repr=False)
    session_token: str | None = setting(text(), repr=False)
    ca_bundle: str | None = setting(text(), env="AWS_CA_BUNDLE")
    verify: bool = setting(flag(), True)
    max_attempts: int = setting(count(1), 8, env="STREAMER_S3_MAX_ATTEMPTS")
    retry_deadline: float = setting(seconds(), 120.0, env="STREAMER_S3_RETRY_DEADLINE")
    connect_timeout: float = setting(seconds(), 10.0, env="STREAMER_S3_CONNECT_TIMEOUT")
    read_timeout: float = setting(seconds(), 30.0, env="STREAMER_S3_READ_TIMEOUT")
    backoff_base: float = setting(seconds(), 0.1)
    backoff_max: float = setting(seconds(), 5.0)
    header_bytes: int = setting(size(16), 256 << 10)
    min_rate: int = setting(size(), 64 << 10, env="STREAMER_S3_MIN_RATE")
    attempt_allowance: float = setting(seconds(), 20.0, env="STREAMER_S3_ATTEMPT_ALLOWANCE")
    low_speed_window: float = setting(seconds(), 10.0, env="STREAMER_S3_LOW_SPEED_WINDOW")
    low_speed_tries: int = setting(count(1), 3, env="STREAMER_S3_LOW_SPEED_TRIES")
    load_deadline: float | None = setting(seconds(optional=True), env="STREAMER_S3_LOAD_DEADLINE")
    require_etag: bool = setting(flag(), True, env="STREAMER_S3_REQUIRE_ETAG")
    max_list_pages: int = setting(count(1), 10_000)

    def __post_init__(self) -> None:
        parse_fields(self, section="s3.")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("give both access_key_id and secret_access_key, or neither")

    def __repr__(self) -> str:
        return _masked_repr(self, ("access_key_id", "secret_access_key", "session_token"))


GCS_ENDPOINT = "https://storage.googleapis.com"


def _emulator(value: object) -> str | None:
    """``STORAGE_EMULATOR_HOST`` as Google's clients read it: a URL, or ``host:port`` (plain HTTP)."""
    host = text()(value)
    if not host:
        return None
    return host if "://" in host else f"http://{host}"


@record
class GCSConfig:
    """How ``gs://`` sources are read. Credentials are Google's Application Default Credentials
    (``GOOGLE_APPLICATION_CREDENTIALS``, workload identity or the metadata server, gcloud's user
    credentials), through ``google-auth``; tokens are refreshed before they expire.

    concurrency: ranged GETs in flight at once (one connection each).
    endpoint_url: the JSON API's endpoint (requests carry credentials); default Google's.
    emulator_host: an emulator (``STORAGE_EMULATOR_HOST``, as Google's clients read it), reached
        without credentials, where no ``endpoint_url`` is given.
    anonymous: unauthenticated requests (public buckets); no credentials are looked up.
    require_generation: every response must carry the generation the header read saw
        (``x-goog-generation``); ``False`` accepts a server that sends none.
    verify_crc32c: every object a handle reads whole is checked against the CRC32C GCS keeps for
        it (``x-goog-hash``) before its last block counts; a mismatch fails the load. Costs one
        CRC pass over the bytes, off the receiving thread (~0.2 CPU-s per GiB).
    The request bounds (``max_attempts`` ... ``max_list_pages``, ``header_bytes``) mean what
    ``S3Config``'s do.
    """

    concurrency: int = setting(count(1, 1024), 64, env="STREAMER_GCS_CONCURRENCY")
    endpoint_url: str | None = setting(text())
    emulator_host: str | None = setting(_emulator, env="STORAGE_EMULATOR_HOST")
    anonymous: bool = setting(flag(), False, env="STREAMER_GCS_ANONYMOUS")
    require_generation: bool = setting(flag(), True, env="STREAMER_GCS_REQUIRE_GENERATION")
    verify_crc32c: bool = setting(flag(), True, env="STREAMER_GCS_VERIFY_CRC32C")
    ca_bundle: str | None = setting(text())
    verify: bool = setting(flag(), True)
    max_attempts: int = setting(count(1), 8, env="STREAMER_GCS_MAX_ATTEMPTS")
    retry_deadline: float = setting(seconds(), 120.0)
    connect_timeout: float = setting(seconds(), 10.0)
    read_timeout: float = setting(seconds(), 30.0, env="STREAMER_GCS_READ_TIMEOUT")
    backoff_base: float = setting(seconds(), 0.1)
    backoff_max: float = setting(seconds(), 5.0)
    header_bytes: int = setting(size(16), 256 << 10)
    min_rate: int = setting(size(), 64 << 10, env="STREAMER_GCS_MIN_RATE")
    attempt_allowance: float = setting(seconds(), 20.0)
    low_speed_window: float = setting(seconds(), 10.0)
    low_speed_tries: int = setting(count(1), 3)
    load_deadline: float | None = setting(seconds(optional=True), env="STREAMER_GCS_LOAD_DEADLINE")
    max_list_pages: int = setting(count(1), 10_000)

    def __post_init__(self) -> None:
        parse_fields(self, section="gcs.")

    @property
    def emulated(self) -> bool:
        """Requests go to the emulator: without credentials, as Google's clients send them."""
        return self.endpoint_url is None and self.emulator_host is not None

    @property
    def endpoint(self) -> str:
        return (self.endpoint_url or self.emulator_host or GCS_ENDPOINT).rstrip("/")


@record  # its own __repr__ masks the credentials
class AzureConfig:
    """How Azure Blob sources (``az://container/key``, ``https://<account>.blob.core.windows.net/...``)
    are read. Credentials, first found: ``sas_token``; ``account_key`` (a read-only SAS is signed
    with it); ``connection_string`` (its key, its SAS, its endpoint: how Azurite is reached);
    ``anonymous`` (public containers); else azure-identity's ``DefaultAzureCredential`` (workload
    identity, managed identity, environment, Azure CLI). Secrets are never shown by ``repr``.

    account: the storage account (``AZURE_STORAGE_ACCOUNT``; a portal URL names its own).
    endpoint_url: the blob endpoint; default the connection string's, else
        ``https://<account>.blob.core.windows.net``.
    The request bounds mean what ``GCSConfig``'s do.
    """

    concurrency: int = setting(count(1, 1024), 64, env="STREAMER_AZURE_CONCURRENCY")
    account: str | None = setting(text(), env="AZURE_STORAGE_ACCOUNT")
    account_key: str | None = setting(text(), env="AZURE_STORAGE_KEY", repr=False)
    sas_token: str | None = setting(text(), env="AZURE_STORAGE_SAS_TOKEN", repr=False)
    connection_string: str | None = setting(text(), env="AZURE_STORAGE_CONNECTION_STRING", repr=False)
    endpoint_url: str | None = setting(text())
    anonymous: bool = setting(flag(), False, env="STREAMER_AZURE_ANONYMOUS")
    ca_bundle: str | None = setting(text())
    verify: bool = setting(flag(), True)
    max_attempts: int = setting(count(1), 8, env="STREAMER_AZURE_MAX_ATTEMPTS")
    retry_deadline: float = setting(seconds(), 120.0)
    connect_timeout: float = setting(seconds(), 10.0)
    read_timeout: float = setting(seconds(), 30.0, env="STREAMER_AZURE_READ_TIMEOUT")
    backoff_base: float = setting(seconds(), 0.1)
    backoff_max: float = setting(seconds(), 5.0)
    header_bytes: int = setting(size(16), 256 << 10)
    min_rate: int = setting(size(), 64 << 10, env="STREAMER_AZURE_MIN_RATE")
    attempt_allowance: float = setting(seconds(), 20.0)
    low_speed_window: float = setting(seconds(), 10.0)
    low_speed_tries: int = setting(count(1), 3)
    load_deadline: float | None = setting(seconds(optional=True), env="STREAMER_AZURE_LOAD_DEADLINE")
    max_list_pages: int = setting(count(1), 10_000)

    def __post_init__(self) -> None:
        parse_fields(self, section="azure.")

    def __repr__(self) -> str:
        return _masked_repr(self, ("account_key", "sas_token", "connection_string"))


def _group(value: object) -> int | None:
    """A group of this host, by name or gid; its gid."""
    if value is None:
        return None
    if isinstance(value, str) and not value.strip().isdigit():
        try:
            return grp.getgrnam(value.strip()).gr_gid
        except KeyError:
            raise ValueError("a group name or gid of this host") from None
    gid: int = count(0)(value)
    return gid


@record
class CacheConfig:
    """A local cache of object-storage blocks, shared by the processes of a node (S3 sources).

    dir: the cache directory; ``None`` (the default, unless ``STREAMER_CACHE_DIR`` is set): no cache.
    max_bytes: cached bytes kept at most (``STREAMER_CACHE_MAX_BYTES``, default 100 GiB); the least
        recently used blocks are evicted beyond it.
    chunk_bytes: the cache's block: objects are cached in pieces of this size on a fixed grid of
        object offsets, so any later load, whatever its layout, finds them.
    shared_group: a group (name or gid) whose members share the directory
        (``STREAMER_CACHE_SHARED_GROUP``): it is made 02770 and files 0660, and one owned by
        that group and not writable by others is used. ``None`` (the default): the directory is
        this user's alone (0700, files 0600); one that another user owns, or that its group or
        others may write, is not used (one ``CacheWarning``; the load goes on without the cache).
    """

    dir: str | None = setting(text(), env="STREAMER_CACHE_DIR")
    max_bytes: int = setting(size(), 100 << 30, env="STREAMER_CACHE_MAX_BYTES")
    chunk_bytes: int = setting(size(4096), 8 << 20)
    shared_group: int | None = setting(_group, env="STREAMER_CACHE_SHARED_GROUP")

    def __post_init__(self) -> None:
        parse_fields(self, section="cache.")

    @property
    def access(self) -> Access:
        """Who may use the directory: this user, or the members of ``shared_group``."""
        return Access(self.shared_group)


GroupVerify = Literal["sampled", "full"]
GROUP_VERIFY: tuple[GroupVerify, ...] = ("sampled", "full")


UNLIMITED: Literal["unlimited"] = "unlimited"
LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")
MemoryLimit = int | Literal["unlimited"] | None


def _shm_dir(value: object) -> str | None:
    """A directory, or None: ``none`` / ``off`` send a group's pieces through its collectives."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    directory: str = text(optional=False)(value)
    return directory


def _memory_limit(value: object) -> MemoryLimit:
    """None, empty or ``auto``: auto; ``unlimited``, ``none`` and ``0`` (their meaning before auto
    existed): ``UNLIMITED``; else a size in bytes."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    if (type(value) is int and value == 0) or (
        isinstance(value, str) and value.strip().lower() in ("none", "unlimited", "0")
    ):
        return UNLIMITED
    try:
        limit: int = size()(value)
    except ValueError:
        raise ValueError("a size in bytes (like 8GiB), None or 'auto', or 'unlimited' (or 0)") from None
    return limit


@record
class StreamerConfig:
    """How a load runs.

    concurrency: reader threads for local files (S3: ``s3.concurrency`` requests in flight).
        ``None`` (the default, or ``STREAMER_CONCURRENCY`` unset) derives it from the machine:
        the usable cores within 8..16 for loads into CPU memory, 8 for staged (GPU) loads
        (``readers()``).
    block_size: bytes per read; tensors are cut into, or grouped by, blocks of this size.
    memory_limit: cap on tensor bytes a streaming load holds in host buffers (in flight, not yet
        handed out, and still referenced by the consumer). ``None`` (the default) sizes it from
        the checkpoint and the memory available (see ``streamer.destinations.budget``); ``"unlimited"`` lets
        readers run ahead without bound; an int is a cap in bytes. ``load()`` keeps every
        tensor, so it ignores the limit on the CPU.
    io_mode: ``auto`` reads a file buffered when the page cache holds most of the bytes this
        read needs of it, else with O_DIRECT: cold, a read through the page cache costs a copy
        and a page-cache page per 4 KiB more (a cold 1 GiB load: 0.6x the CPU seconds with
        O_DIRECT, as fast or faster; README). ``buffered`` or ``direct`` force one strategy.
    hugepages: back CPU destination buffers and the GPU staging ring of 4 MiB or more with
        transparent huge pages (``STREAMER_HUGEPAGES``, 1 or 0). On by default wherever the
        kernel has THP (``enabled`` not ``never``): ~600 page faults per GiB instead of ~262,000.
        Off by default on VMs with free page reporting (``free_page_reporting``), where every
        fresh huge page is memory the host took back: there 4 KiB pages loaded 1 GiB 2-4x
        faster, cold and warm (README).
    page_fill: create the fresh pages of CPU destination buffers already holding the bytes read
        (userfaultfd's ``UFFDIO_COPY``, ``STREAMER_PAGE_FILL``, 1 or 0) instead of having a page
        fault zero each 4 KiB page before the read overwrites it. ``None`` (the default) turns it
        on wherever buffers take 4 KiB pages (``hugepages`` off): there it loaded a warm
        1 GiB checkpoint 1.6x faster, and a cold one (read with O_DIRECT into a huge-page buffer
        of each reader, then placed) 1.9x (README). Used for local files; where the kernel or a
        seccomp filter refuses userfaultfd, loads go on without it (``metrics["page_fill"]`` says
        why).
    inline_max_bytes: a run of local files into CPU memory of at most this many bytes (default
        64 MiB, ``STREAMER_INLINE_MAX_BYTES``) is read by the caller's thread and torch's intra-op
        threads, each tensor into memory of its own, without the engine's reader threads
        (``streamer.run.inline``): on 2 cores, 1.2-4x faster than the engine from 1.5 to 64 MiB,
        warm and cold (``benchmarks/small_files.py --sizes 1.5MiB,16MiB,64MiB [--cold]``); larger
        runs need the engine's queue depth cold. 0 reads every run through the engine.
    group_timeout: seconds a group load (``group=``) waits on any one collective (one round of
        pieces, default 30, ``STREAMER_GROUP_TIMEOUT``) before raising: how long the other ranks
        wait for a rank that died or stopped calling.
    group_verify: how ranks of a group load check that they opened the same checkpoint before a
        byte moves (``STREAMER_GROUP_VERIFY``): every file's size and whole header always, and
        its version: an object's ETag; for a local file the same device and inode on one host,
        else ``sampled`` (the default) a hash of 32 blocks spread over it, or ``full`` a hash of
        every byte (one whole read of each file on every rank, before the load).
    group_shm_dir: a tmpfs where the ranks of a CPU (gloo) group on one host share what they
        read instead of sending it over gloo's loopback TCP: one copy of the checkpoint per host,
        or small outboxes under a memory limit (default ``/dev/shm``, ``STREAMER_GROUP_SHM_DIR``;
        ``None``, or the variable set to ``none``, sends pieces through the group's collectives).
        Ranks that cannot all map the same files (other hosts, other containers, a full tmpfs)
        fall back to the collectives on their own.
    s3, gcs, azure: how ``s3://``, ``gs://`` and Azure Blob sources are read (``S3Config``,
        ``GCSConfig``, ``AzureConfig``).
    cache: a local cache in front of object storage (off unless ``cache.dir`` is set).
    metrics: record every load in Prometheus collectors (``STREAMER_METRICS``, off by default;
        the ``[prometheus]`` extra): ``streamer.metrics`` lists them and serves them.
    metrics_textfile: after every load, write this process's ``streamer_*`` series to this file
        in the node exporter's textfile format (``STREAMER_METRICS_TEXTFILE``; ``{pid}`` in the
        path becomes the process id); turns ``metrics`` on.
    log_format: the one INFO event each load logs on the ``streamer`` logger: ``text`` (a line
        for people) or ``json`` (one object per line, for log pipelines); ``STREAMER_LOG_FORMAT``.
    """

    concurrency: int | None = setting(count(1, 1024, optional=True), env="STREAMER_CONCURRENCY")
    block_size: int = setting(size(), 8 << 20, env="STREAMER_BLOCK_SIZE")
    memory_limit: MemoryLimit = setting(_memory_limit, env="STREAMER_MEMORY_LIMIT")
    io_mode: IoMode = setting(choice(IO_MODES), "auto", env="STREAMER_IO_MODE")
    hugepages: bool = setting(flag(), hugepages_by_default, env="STREAMER_HUGEPAGES")
    page_fill: bool | None = setting(flag(optional=True), env="STREAMER_PAGE_FILL")
    s3: S3Config = field(default_factory=S3Config)
    gcs: GCSConfig = field(default_factory=GCSConfig)
    azure: AzureConfig = field(default_factory=AzureConfig)
    inline_max_bytes: int = setting(size(0), 64 << 20, env="STREAMER_INLINE_MAX_BYTES")
    group_timeout: float = setting(seconds(), 30.0, env="STREAMER_GROUP_TIMEOUT")
    group_verify: GroupVerify = setting(choice(GROUP_VERIFY), "sampled", env="STREAMER_GROUP_VERIFY")
    group_shm_dir: str | None = setting(_shm_dir, "/dev/shm", env="STREAMER_GROUP_SHM_DIR")
    cache: CacheConfig = field(default_factory=CacheConfig)
    metrics: bool = setting(flag(), False, env="STREAMER_METRICS")
    metrics_textfile: str | None = setting(text(), env="STREAMER_METRICS_TEXTFILE")
    log_format: LogFormat = setting(choice(LOG_FORMATS), "text", env="STREAMER_LOG_FORMAT")

    @property
    def records_metrics(self) -> bool:
        """Whether loads are recorded in Prometheus collectors (``metrics``, or a textfile to write)."""
        return self.metrics or self.metrics_textfile is not None

    @property
    def explicit_memory_limit(self) -> int | None:
        """The limit in bytes when the user gave one; None for auto or unlimited."""
        return self.memory_limit if isinstance(self.memory_limit, int) else None

    def readers(self) -> int:
        """Reader threads for local files: ``concurrency``, else derived from the usable cores."""
        if self.concurrency is not None:
            return self.concurrency
        return self._machine_readers

    @functools.cached_property
    def _machine_readers(self) -> int:
        # Probed once per config: the cgroup files take ~80 us to read, a small get_tensor ~0.8 ms.
        return default_readers(cores=usable_cores())

    def fills_pages(self) -> bool:
        """Whether fresh CPU buffers are filled through the page fill: ``page_fill``, else where they
        take 4 KiB pages (a huge page's one fault per 2 MiB costs less than filling 512 pages)."""
        return self.page_fill if self.page_fill is not None else not self.hugepages

    def for_staged(self) -> StreamerConfig:
        """This config for a staged (GPU) run: an unset ``concurrency`` becomes ``STAGED_READERS``."""
        if self.concurrency is not None:
            return self
        return dataclasses.replace(self, concurrency=STAGED_READERS)

    def __post_init__(self) -> None:
        parse_fields(self)


class _EnvironmentDefault:
    """The config of calls given none: ``StreamerConfig()``, built again only when a variable that
    some config reads was set, changed or unset since the last one, when the machine's default for
    ``hugepages`` changed, or after ``KEEP_SECONDS`` (as long as the machine facts that configs
    probe are kept). Building one reads ~50 variables and parses ~80 fields, ~100 us: a fifth of
    loading a 1.5 MiB file."""

    KEEP_SECONDS = 1.0

    def __init__(self) -> None:
        self._names = variables(StreamerConfig, S3Config, GCSConfig, AzureConfig, CacheConfig)
        self._kept: tuple[tuple[object, ...], float, StreamerConfig] | None = None

    def get(self) -> StreamerConfig:
        snapshot = (*environment_snapshot(self._names), hugepages_by_default())
        now = time.monotonic()
        kept = self._kept  # one read: another thread may replace it (configs are frozen, so shared)
        if kept is not None and kept[0] == snapshot and now - kept[1] < self.KEEP_SECONDS:
            return kept[2]
        config = StreamerConfig()
        self._kept = (snapshot, now, config)
        return config


default_config = _EnvironmentDefault().get
"""``StreamerConfig()`` as the environment says now, shared by the calls given no config."""

"""The one typed configuration object, with environment variables as defaults.

Environment variables are read when a ``StreamerConfig`` is built, never
written: two loaders in one process can use different settings.
"""

from __future__ import annotations

import dataclasses
import functools
import grp
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from streamer.errors import ConfigError
from streamer.safedir import Access

IoMode = Literal["auto", "buffered", "direct"]
IO_MODES: tuple[IoMode, ...] = ("auto", "buffered", "direct")

DIRECT_IO_ALIGNMENT = 4096
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, *, name: str) -> int:
    """Parses ``"64MiB"``, ``"2G"``, ``"4096"`` (binary units) into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_PATTERN.match(text)
    if match is None:
        raise ConfigError(f"{name}: cannot parse size {text!r} (examples: 8MiB, 2G, 4096)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def _env_int(name: str, default: int) -> int:
    value = _env_optional_int(name)
    return default if value is None else value


def _env_optional_flag(name: str) -> bool | None:
    """A 1 / 0 variable; unset or empty is None (decided by the machine)."""
    value = _env_optional_int(name)
    return None if value is None else value != 0


def _env_optional_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


# Reader threads when ``concurrency`` is left to the machine. Warm reads are page-cache copies, so
# they scale with cores: on a 16-core host, 16 readers loaded a warm 4 GiB checkpoint into CPU
# memory 1.4-1.5x faster than 8 (10 of 10 rounds), and 32 were no faster than 16. Cold reads did
# not care (8 or 16). Staged (GPU) runs keep 8: there 16 were 7% slower warm, from their larger
# pinned ring (README, Configuration).
MIN_READERS = 8
MAX_READERS = 16
STAGED_READERS = 8
CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


def usable_cores(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> int:
    """CPUs this process can keep busy: its affinity, cut by its cgroup's CPU quota (containers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, self_cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota is not None else max(1, cores)


def cgroup_cpu_quota(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> float | None:
    """CPUs' worth of time per period the process's cgroup may use; None when unlimited or unknown.

    cgroup v2: the tightest ``cpu.max`` ("max 100000" or "<quota> <period>") of the process's own
    cgroup (as ``self_cgroup`` names it under ``cgroup_root``) and its ancestors; v1: the ``cpu``
    controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: unlimited).
    """
    root = Path(cgroup_root)
    own = PurePosixPath("/", _own_cgroup(self_cgroup))
    found, quotas = False, []
    for cgroup in (own, *own.parents):
        try:
            quota, period = (root / cgroup.relative_to("/") / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        found = True
        share = None if quota == "max" else _quota(quota, period)
        if share is not None:
            quotas.append(share)
    if found:
        return min(quotas, default=None)
    try:
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _quota(quota, period)


def _own_cgroup(self_cgroup: str) -> str:
    """The process's cgroup v2 path (the ``0::<path>`` line of ``self_cgroup``), else "/"."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return "/"
    return next((line[3:].strip() or "/" for line in lines if line.startswith("0::")), "/")


def _quota(quota: str, period: str) -> float | None:
    try:
        share = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return share if share > 0 else None


def default_readers(*, cores: int) -> int:
    """Reader threads of a load into CPU memory when ``concurrency`` is unset (see ``MIN_READERS``)."""
    return min(MAX_READERS, max(MIN_READERS, cores))


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


BALLOON_DEVICES = "/sys/bus/virtio/drivers/virtio_balloon"
_BALLOON_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING, a bit of the device's negotiated features


def _transparent_hugepages() -> bool:
    """Whether the kernel gives huge pages to memory that asks (THP ``always`` or ``madvise``)."""
    try:
        with open(THP_SETTING) as setting:
            return "[never]" not in setting.read()
    except OSError:
        return False  # no THP (another OS, or a kernel without it)


def free_page_reporting() -> bool:
    """Whether this is a VM whose balloon hands free memory back to the host (free page reporting).

    Such a kernel reports each free block of 2 MiB or more to the host, which discards it; the
    next process to use that memory has the host fault every 4 KiB of it back in. Huge pages are
    always carved from those blocks; 4 KiB pages come first from smaller free blocks, which are
    never reported. ``features`` is the negotiated feature bits, one character per bit.
    """
    try:
        devices = list(Path(BALLOON_DEVICES).glob("virtio*"))
        features = [(device / "features").read_text().strip() for device in devices]
    except OSError:
        return False
    return any(len(bits) > _BALLOON_F_REPORTING and bits[_BALLOON_F_REPORTING] == "1" for bits in features)


def _hugepages_by_default() -> bool:
    """Huge pages where the kernel has them, except on VMs with free page reporting (see there)."""
    return _transparent_hugepages() and not free_page_reporting()


def _env_io_mode() -> IoMode:
    raw = os.environ.get("STREAMER_IO_MODE", "auto").strip().lower()
    for mode in IO_MODES:
        if raw == mode:
            return mode
    raise ConfigError(f"STREAMER_IO_MODE={raw!r}: expected one of {', '.join(IO_MODES)}")


def _env_str(*names: str) -> str | None:
    """The first of ``names`` set to a non-empty value."""
    for name in names:
        raw = os.environ.get(name)
        if raw is not None and raw.strip():
            return raw.strip()
    return None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def _env_flag(name: str) -> bool:
    raw = (os.environ.get(name) or "").strip().lower()
    return raw not in ("", "0", "false", "no", "off")


def _env_seconds(name: str) -> float | None:
    """Seconds, or ``None`` when unset, empty or ``none``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip().lower() in ("", "none"):
        return None
    return _env_float(name, 0.0)


AddressingStyle = Literal["auto", "path", "virtual"]
ADDRESSING_STYLES: tuple[AddressingStyle, ...] = ("auto", "path", "virtual")


def _env_addressing() -> AddressingStyle:
    raw = (os.environ.get("STREAMER_S3_ADDRESSING_STYLE") or "auto").strip().lower()
    for style in ADDRESSING_STYLES:
        if raw == style:
            return style
    raise ConfigError(f"STREAMER_S3_ADDRESSING_STYLE={raw!r}: expected one of {', '.join(ADDRESSING_STYLES)}")


_MASK = "***"


@dataclass(frozen=True)
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

    concurrency: int = field(default_factory=lambda: _env_int("STREAMER_S3_CONCURRENCY", 64))
    endpoint_url: str | None = field(
        default_factory=lambda: _env_str("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    )
    region: str | None = field(default_factory=lambda: _env_str("AWS_REGION", "AWS_DEFAULT_REGION"))
    addressing_style: AddressingStyle = field(default_factory=_env_addressing)
    anonymous: bool = field(default_factory=lambda: _env_flag("STREAMER_S3_ANONYMOUS"))
    profile: str | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    ca_bundle: str | None = field(default_factory=lambda: _env_str("AWS_CA_BUNDLE"))
    verify: bool = True
    max_attempts: int = field(default_factory=lambda: _env_int("STREAMER_S3_MAX_ATTEMPTS", 8))
    retry_deadline: float = field(default_factory=lambda: _env_float("STREAMER_S3_RETRY_DEADLINE", 120.0))
    connect_timeout: float = field(default_factory=lambda: _env_float("STREAMER_S3_CONNECT_TIMEOUT", 10.0))
    read_timeout: float = field(default_factory=lambda: _env_float("STREAMER_S3_READ_TIMEOUT", 30.0))
    backoff_base: float = 0.1
    backoff_max: float = 5.0
    header_bytes: int = 256 << 10
    min_rate: int = field(
        default_factory=lambda: parse_size(
            os.environ.get("STREAMER_S3_MIN_RATE") or "64KiB", name="STREAMER_S3_MIN_RATE"
        )
    )
    attempt_allowance: float = field(
        default_factory=lambda: _env_float("STREAMER_S3_ATTEMPT_ALLOWANCE", 20.0)
    )
    low_speed_window: float = field(default_factory=lambda: _env_float("STREAMER_S3_LOW_SPEED_WINDOW", 10.0))
    low_speed_tries: int = field(default_factory=lambda: _env_int("STREAMER_S3_LOW_SPEED_TRIES", 3))
    load_deadline: float | None = field(default_factory=lambda: _env_seconds("STREAMER_S3_LOAD_DEADLINE"))
    require_etag: bool = field(default_factory=lambda: _env_int("STREAMER_S3_REQUIRE_ETAG", 1) != 0)
    max_list_pages: int = 10_000

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= 1024:
            raise ConfigError(f"s3 concurrency must be in 1..1024, got {self.concurrency}")
        if self.addressing_style not in ADDRESSING_STYLES:
            styles = ", ".join(ADDRESSING_STYLES)
            raise ConfigError(f"addressing_style must be one of {styles}, got {self.addressing_style!r}")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("give both access_key_id and secret_access_key, or neither")
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.low_speed_tries < 1:
            raise ConfigError(f"low_speed_tries must be at least 1, got {self.low_speed_tries}")
        if self.min_rate < 1 or self.max_list_pages < 1:
            raise ConfigError("min_rate and max_list_pages must be positive")
        if self.load_deadline is not None and not self.load_deadline > 0:
            raise ConfigError(f"load_deadline must be positive or None, got {self.load_deadline}")
        for name in (
            "retry_deadline",
            "connect_timeout",
            "read_timeout",
            "backoff_base",
            "backoff_max",
            "attempt_allowance",
            "low_speed_window",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.header_bytes < 16:
            raise ConfigError(f"header_bytes must be at least 16, got {self.header_bytes}")

    def __repr__(self) -> str:
        shown = []
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if name in ("access_key_id", "secret_access_key", "session_token"):
                value = None if value is None else _MASK
            shown.append(f"{name}={value!r}")
        return f"S3Config({', '.join(shown)})"


def _env_cache_max_bytes() -> int:
    raw = os.environ.get("STREAMER_CACHE_MAX_BYTES")
    return parse_size(raw, name="STREAMER_CACHE_MAX_BYTES") if raw else 100 * 1024**3


@dataclass(frozen=True)
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

    dir: str | None = field(default_factory=lambda: _env_str("STREAMER_CACHE_DIR"))
    max_bytes: int = field(default_factory=_env_cache_max_bytes)
    chunk_bytes: int = 8 * 1024 * 1024
    shared_group: str | int | None = field(default_factory=lambda: _env_str("STREAMER_CACHE_SHARED_GROUP"))

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ConfigError(f"cache max_bytes must be positive, got {self.max_bytes}")
        if self.chunk_bytes < 4096:
            raise ConfigError(f"cache chunk_bytes must be at least 4096, got {self.chunk_bytes}")
        if self.shared_group is not None:
            self._group_id()  # an unknown group is an error now, not at the first load

    @property
    def access(self) -> Access:
        """Who may use the directory: this user, or the members of ``shared_group``."""
        return Access(None if self.shared_group is None else self._group_id())

    def _group_id(self) -> int:
        group = self.shared_group
        if isinstance(group, int) and not isinstance(group, bool) and group >= 0:
            return group
        if isinstance(group, str) and group.strip().isdigit():
            return int(group.strip())
        if isinstance(group, str) and group.strip():
            try:
                return grp.getgrnam(group.strip()).gr_gid
            except KeyError:
                pass
        raise ConfigError(f"cache shared_group must be a group name or gid of this host, got {group!r}")


GroupVerify = Literal["sampled", "full"]
GROUP_VERIFY: tuple[GroupVerify, ...] = ("sampled", "full")


def _env_group_verify() -> GroupVerify:
    raw = (os.environ.get("STREAMER_GROUP_VERIFY") or "sampled").strip().lower()
    for mode in GROUP_VERIFY:
        if raw == mode:
            return mode
    raise ConfigError(f"STREAMER_GROUP_VERIFY={raw!r}: expected one of {', '.join(GROUP_VERIFY)}")


UNLIMITED: Literal["unlimited"] = "unlimited"
MemoryLimit = int | Literal["unlimited"] | None


def _env_group_shm_dir() -> str | None:
    raw = os.environ.get("STREAMER_GROUP_SHM_DIR")
    if raw is None:
        return "/dev/shm"
    return None if raw.strip().lower() in ("", "none", "off") else raw.strip()


def _env_memory_limit() -> MemoryLimit:
    """``STREAMER_MEMORY_LIMIT``: unset, empty or ``auto`` is None (auto); ``unlimited``, ``none``
    and ``0`` (their meaning before auto existed) are ``UNLIMITED``; anything else is a size."""
    raw = (os.environ.get("STREAMER_MEMORY_LIMIT") or "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("none", "unlimited", "0"):
        return UNLIMITED
    return parse_size(raw, name="STREAMER_MEMORY_LIMIT")


@dataclass(frozen=True)
class StreamerConfig:
    """How a load runs.

    concurrency: reader threads for local files (S3: ``s3.concurrency`` requests in flight).
        ``None`` (the default, or ``STREAMER_CONCURRENCY`` unset) derives it from the machine:
        the usable cores within 8..16 for loads into CPU memory, 8 for staged (GPU) loads
        (``readers()``).
    block_size: bytes per read; tensors are cut into, or grouped by, blocks of this size.
    memory_limit: cap on tensor bytes a streaming load holds in host buffers (in flight, not yet
        handed out, and still referenced by the consumer). ``None`` (the default) sizes it from
        the checkpoint and the memory available (see ``streamer.memory``); ``"unlimited"`` lets
        readers run ahead without bound; an int is a cap in bytes. ``load()`` keeps every
        tensor, so it ignores the limit on the CPU.
    io_mode: ``auto`` reads a file buffered when the page cache holds most of the bytes this
        read needs of it, else with O_DIRECT; ``buffered`` or ``direct`` force one strategy.
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
        1 GiB checkpoint 1.6x faster (README). Used for local files; where the kernel or a seccomp
        filter refuses userfaultfd, loads go on without it (``metrics["page_fill"]`` says why).
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
    cache: a local cache in front of object storage (off unless ``cache.dir`` is set).
    """

    concurrency: int | None = field(default_factory=lambda: _env_optional_int("STREAMER_CONCURRENCY"))
    block_size: int = field(
        default_factory=lambda: parse_size(
            os.environ.get("STREAMER_BLOCK_SIZE") or "8MiB", name="STREAMER_BLOCK_SIZE"
        )
    )
    memory_limit: MemoryLimit = field(default_factory=_env_memory_limit)
    io_mode: IoMode = field(default_factory=_env_io_mode)
    hugepages: bool = field(
        default_factory=lambda: _env_int("STREAMER_HUGEPAGES", int(_hugepages_by_default())) != 0
    )
    page_fill: bool | None = field(default_factory=lambda: _env_optional_flag("STREAMER_PAGE_FILL"))
    s3: S3Config = field(default_factory=S3Config)
    group_timeout: float = field(default_factory=lambda: _env_float("STREAMER_GROUP_TIMEOUT", 30.0))
    group_verify: GroupVerify = field(default_factory=_env_group_verify)
    group_shm_dir: str | None = field(default_factory=_env_group_shm_dir)
    cache: CacheConfig = field(default_factory=CacheConfig)

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
        if self.concurrency is not None and not 1 <= self.concurrency <= 1024:
            raise ConfigError(f"concurrency must be in 1..1024, got {self.concurrency}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        limit = self.memory_limit
        if limit is not None and limit != UNLIMITED and (not isinstance(limit, int) or limit < 1):
            raise ConfigError(
                f"memory_limit must be a positive number of bytes, None (auto) or 'unlimited', got {limit!r}"
            )
        if not self.group_timeout > 0:
            raise ConfigError(f"group_timeout must be positive, got {self.group_timeout}")
        if self.group_verify not in GROUP_VERIFY:
            raise ConfigError(
                f"group_verify must be one of {', '.join(GROUP_VERIFY)}, got {self.group_verify!r}"
            )
        if self.io_mode not in IO_MODES:
            raise ConfigError(f"io_mode must be one of {', '.join(IO_MODES)}, got {self.io_mode!r}")

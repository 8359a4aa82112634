"""What the machine allows, measured in the same run: the figures a loader is divided by.

- sequential reads of the checkpoint's own files, buffered and O_DIRECT, 2..8 parallel
  readers, the best median of ``--repeat`` runs (``fio`` when it is on PATH, else a threaded
  ``pread`` reader in Python);
- ``memcpy`` into memory that is already touched (numpy, one thread; torch, all threads);
- first touch of fresh anonymous memory (MAP_PRIVATE), 4 KiB pages and transparent huge pages;
- the page fill: fresh 4 KiB pages created holding bytes copied from touched memory (userfaultfd's
  ``UFFDIO_COPY``, as streamer's CPU loads fill their buffers where pages are 4 KiB), all cores;
- pinned host-to-device copy when CUDA is present;
- S3 sources: plain boto3 ranged GETs through the same endpoint (the boto3 loader's runs, timed
  interleaved with the loaders'); the local read ceilings do not apply there.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamer_bench.runner import Config
from streamer_bench.units import gbps

# One reader was never the best on the disks measured (buffered at its best with 4-8, O_DIRECT 2-8).
JOB_COUNTS = (2, 4, 8)
READ_BLOCK = 1 << 20
FIRST_TOUCH_PROBE = 256 << 20  # ~0.1 s at this VM's usual 2.8 GB/s
_DIRECT_ALIGN = 4096
_LOCAL_READS = ("read_buffered", "read_direct")


@dataclass
class Ceiling:
    """One reference figure: its best rate and how it was obtained."""

    # read_buffered | read_direct | s3_ranged_get | sdk_read | memcpy | first_touch |
    # first_touch_hugepage | page_fill | h2d_pinned
    name: str
    cache: str | None  # cold | warm | remote for reads, None for memory
    gbps: float | None
    method: str  # fio | python | boto3 | numpy | torch | mmap | userfaultfd | none
    detail: str
    samples: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    jobs: int | None = None  # a read ceiling's reader count: the one with the best median
    # A read ceiling measured again at the start of each round of loads ({"round", "gbps"}): the
    # disk drifts within a section, so loads are also divided by the ceiling of their own round.
    rounds: list[dict[str, Any]] = field(default_factory=list)


# --- storage ---


def _slices(files: Sequence[Path], jobs: int, direct: bool) -> list[list[tuple[Path, int, int]]]:
    """Waves of (file, offset, length) jobs, ``jobs`` at a time, together covering every file."""
    sizes = [f.stat().st_size for f in files]
    if jobs < len(files):  # fewer readers than files: whole files, ``jobs`` at a time
        pieces = [(f, 0, s) for f, s in zip(files, sizes, strict=True)]
        waves = [pieces[i : i + jobs] for i in range(0, len(pieces), jobs)]
    else:  # readers spread over files in proportion to their size, at least one each
        share = [1] * len(files)
        for _ in range(jobs - len(files)):
            share[max(range(len(files)), key=lambda i: sizes[i] / share[i])] += 1
        wave: list[tuple[Path, int, int]] = []
        for f, size, k in zip(files, sizes, share, strict=True):
            step = -(-size // k // READ_BLOCK) * READ_BLOCK or READ_BLOCK
            wave += [(f, off, min(step, size - off)) for off in range(0, size, step)]
        waves = [wave]
    if direct:  # O_DIRECT lengths must be block multiples; the dropped tail is under 4 KiB per job
        waves = [[(f, o, n // _DIRECT_ALIGN * _DIRECT_ALIGN) for f, o, n in w] for w in waves]
    return [[p for p in w if p[2] > 0] for w in waves]


def _fio_jobfile(waves: list[list[tuple[Path, int, int]]], direct: bool) -> str:
    lines = [
        "[global]",
        "rw=read",
        f"bs={READ_BLOCK}",
        "ioengine=psync",
        f"direct={int(direct)}",
        "invalidate=0",  # the caller decides what is cached
        "",
    ]
    n = 0
    for wave in waves:
        for i, (path, offset, length) in enumerate(wave):
            name = str(path).replace(":", "\\:")
            lines += [f"[r{n}]", f"filename={name}", f"offset={offset}", f"size={length}"]
            if i == 0 and n > 0:
                lines.append("stonewall")
            lines.append("")
            n += 1
    return "\n".join(lines)


def _fio_rate(waves: list[list[tuple[Path, int, int]]], direct: bool) -> tuple[int, float]:
    """Bytes and seconds of one fio run (seconds summed over waves, each its slowest job)."""
    with tempfile.NamedTemporaryFile("w", suffix=".fio", delete=False) as fh:
        fh.write(_fio_jobfile(waves, direct))
    try:
        out = subprocess.run(
            ["fio", "--output-format=json", fh.name], capture_output=True, text=True, check=True, timeout=1800
        ).stdout
    finally:
        os.unlink(fh.name)
    report = json.loads(out[out.index("{") :])
    nbytes, per_group = 0, {}  # type: tuple[int, dict[int, float]]
    for job in report["jobs"]:
        nbytes += int(job["read"]["io_bytes"])
        group = int(job["groupid"])
        per_group[group] = max(per_group.get(group, 0.0), float(job["read"]["runtime"]) / 1000)
    return nbytes, sum(per_group.values())


def _aligned_buffer(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _python_rate(waves: list[list[tuple[Path, int, int]]], direct: bool) -> tuple[int, float]:
    """The same plan read by one thread per job with ``preadv`` into an aligned 1 MiB buffer."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    errors: list[BaseException] = []
    done = [0]
    lock = threading.Lock()

    def read(path: Path, offset: int, length: int) -> None:
        try:
            buffer = _aligned_buffer(READ_BLOCK)
            fd = os.open(path, flags)
            try:
                end, n = offset + length, 0
                while offset < end:
                    got = os.preadv(fd, [memoryview(buffer)[: min(READ_BLOCK, end - offset)]], offset)
                    if got <= 0:
                        break
                    offset += got
                    n += got
            finally:
                os.close(fd)
                buffer.close()
            with lock:
                done[0] += n
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    seconds = 0.0
    for wave in waves:
        threads = [threading.Thread(target=read, args=piece) for piece in wave]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds += time.perf_counter() - start
    if errors:
        raise errors[0]
    return done[0], seconds


def _start_like_a_load(cache: str | None, direct: bool, prepare: Callable[[], None], settle: float) -> None:
    """Resets the cache state with ``prepare``; a buffered cold read then waits the loads' settle.

    It fills the page cache: fresh memory, which a load meets after the VM had ``settle`` seconds
    to hand it back to the host. Right after an eviction fio refilled the pages the eviction had
    just freed, and read 2.16 GB/s against 1.40 after the settle (2026-12-02, 1 GiB, 8 jobs, 6
    interleaved runs each): a ceiling no load could meet. O_DIRECT and warm reads fill no memory.
    """
    prepare()
    if cache == "cold" and not direct:
        time.sleep(settle)


def storage_ceilings(
    files: Sequence[Path],
    cache: str,
    prepare: Callable[[], None],
    *,
    modes: Sequence[str] = ("buffered", "direct"),
    use_fio: bool = True,
    repeat: int = 1,
    settle: float = 0.0,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Ceiling]:
    """Sequential read rate per mode: the best, over 2..8 readers, of the median of ``repeat``
    runs (rounds interleave the reader counts); ``prepare`` resets the cache state, and a sample
    it fails (a ``RuntimeError``, such as ``CacheStateError``) is recorded as that sample's error.
    A buffered cold run starts ``settle`` seconds after it, as the loads do.

    A median, not the best single run: on shared VMs one cold run in several is 2-3x the others,
    and a ceiling picked from single samples would measure that luck, not the storage.
    """
    method = "fio" if use_fio and shutil.which("fio") else "python"
    rate = _fio_rate if method == "fio" else _python_rate
    out: list[Ceiling] = []
    for mode in modes:
        direct = mode == "direct"
        ceiling = Ceiling(f"read_{mode}", cache, None, method, "")
        rates: dict[int, list[float]] = {jobs: [] for jobs in JOB_COUNTS}
        for run in range(1, repeat + 1):
            for jobs in JOB_COUNTS:
                progress(f"{cache} read ceiling: {method} {mode}, {jobs} job(s), run {run}/{repeat}")
                try:
                    _start_like_a_load(cache, direct, prepare, settle)
                    nbytes, seconds = rate(_slices(files, jobs, direct), direct)
                except (OSError, RuntimeError, subprocess.SubprocessError, ValueError, KeyError) as exc:
                    ceiling.samples.append({"jobs": jobs, "error": str(exc)[:300]})
                    continue
                value = gbps(nbytes, seconds) if seconds > 0 else None
                ceiling.samples.append({"jobs": jobs, "bytes": nbytes, "seconds": seconds, "gbps": value})
                if value is not None:
                    rates[jobs].append(value)
        for jobs, values in rates.items():
            median = statistics.median(values) if values else None
            if median is not None and (ceiling.gbps is None or median > ceiling.gbps):
                ceiling.gbps, ceiling.jobs = median, jobs
                ceiling.detail = (
                    f"{jobs} job(s), {READ_BLOCK >> 20} MiB reads, median of {len(values)} "
                    f"(min-max {min(values):.2f}-{max(values):.2f})"
                )
        if ceiling.gbps is None:
            ceiling.error = "; ".join(str(s.get("error", "too fast to time")) for s in ceiling.samples)
        out.append(ceiling)
    return out


def measure_round(
    ceiling: Ceiling,
    files: Sequence[Path],
    prepare: Callable[[], None],
    round_index: int,
    settle: float = 0.0,
    progress: Callable[[str], None] = lambda _: None,
) -> None:
    """One more run of a read ceiling at its best reader count, for round ``round_index`` of the
    loads (``Ceiling.rounds``), started as ``storage_ceilings`` starts its runs; a run that fails
    is left out, as a failed load is."""
    if ceiling.jobs is None or ceiling.cache is None:
        return
    direct = ceiling.name == "read_direct"
    rate = _fio_rate if ceiling.method == "fio" else _python_rate
    what = f"{ceiling.method} {ceiling.name}, {ceiling.jobs} job(s)"
    progress(f"{ceiling.cache} read ceiling: {what}, before round {round_index + 1}")
    try:
        _start_like_a_load(ceiling.cache, direct, prepare, settle)
        nbytes, seconds = rate(_slices(files, ceiling.jobs, direct), direct)
    except (OSError, RuntimeError, subprocess.SubprocessError, ValueError, KeyError):
        return
    if seconds > 0:
        ceiling.rounds.append({"round": round_index, "gbps": gbps(nbytes, seconds)})
        fold_rounds(ceiling)


def fold_rounds(ceiling: Ceiling) -> None:
    """A read ceiling measured again before rounds (``measure_round`` calls this after each) is the
    median of every run at its reader count: those before the section and those before the rounds.

    Runs before the section follow each other; those before the rounds follow loads, as loads do.
    They read at different rates on VMs (the 05:46 main job of 2026-12-02: 1.78 and 2.84 GB/s
    before the section, ~1.3 before its rounds), and the table divides by one figure: the one from
    all of them.
    """
    if not ceiling.rounds or ceiling.jobs is None:
        return
    before = [float(s["gbps"]) for s in ceiling.samples if s.get("jobs") == ceiling.jobs and s.get("gbps")]
    values = before + [float(r["gbps"]) for r in ceiling.rounds]
    ceiling.gbps = statistics.median(values)
    ceiling.detail = (
        f"{ceiling.jobs} job(s), {READ_BLOCK >> 20} MiB reads, median of {len(values)}: {len(before)} before "
        f"the section, {len(ceiling.rounds)} before its rounds (min-max {min(values):.2f}-{max(values):.2f})"
    )


def remote_ceilings(scheme: str, reference_configs: Sequence[Config]) -> list[Ceiling]:
    """Remote sources: the store's reference loader at its best setting (bytes over its median
    run) as the ceiling (S3: boto3's ranged GETs; GCS, Azure: the SDK's parallel reads); the local
    read ceilings listed as not applicable, so a reader sees why they are absent."""
    tool = {"s3": "boto3", "gs": "google-cloud-storage", "az": "azure-storage-blob"}[scheme]
    ceiling = Ceiling("s3_ranged_get" if scheme == "s3" else "sdk_read", "remote", None, tool, "")
    for config in reference_configs:
        valid = [r for r in config.runs if r.valid and r.seconds and r.bytes]
        if not valid:
            continue
        median = statistics.median(r.seconds or 0.0 for r in valid)
        nbytes = max(r.bytes or 0 for r in valid)
        value = gbps(nbytes, median)
        setting = config.setting.label
        ceiling.samples.append({"setting": setting, "bytes": nbytes, "median_s": median, "gbps": value})
        if ceiling.gbps is None or value > ceiling.gbps:
            ceiling.gbps = value
            ceiling.detail = f"{'; '.join(valid[0].notes)}; median of {len(valid)} run(s)"
    if ceiling.gbps is None:
        ceiling.error = f"not measured: {tool} did not run (not asked for with --loaders, skipped or failed)"
    local = f"not applicable: the checkpoint is on {scheme}://, there are no local files to read"
    return [ceiling, *(Ceiling(name, "remote", None, "none", "", error=local) for name in _LOCAL_READS)]


# --- memory ---


def _best_seconds(run: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def memcpy_ceiling(size: int) -> Ceiling:
    """Copy into touched memory: numpy (one thread) and torch (all threads); the faster one."""
    import numpy as np
    import torch

    src = np.ones(size, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    dst.fill(0)  # touched: page faults are the first-touch ceiling's business, not this one's
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    rates = {
        ("numpy", 1): gbps(size, _best_seconds(lambda: np.copyto(dst, src))),
        ("torch", torch.get_num_threads()): gbps(size, _best_seconds(lambda: tdst.copy_(tsrc))),
    }
    (method, threads), best = max(rates.items(), key=lambda item: item[1])
    samples: list[dict[str, Any]] = [{"method": m, "threads": t, "gbps": r} for (m, t), r in rates.items()]
    detail = f"{size >> 20} MiB, {threads} thread(s), best of 3"
    return Ceiling("memcpy", None, best, method, detail, samples)


def first_touch_seconds(size: int, hugepage: bool = False) -> float:
    """Writing one byte per 4 KiB page of a fresh MAP_PRIVATE anonymous mapping (one thread)."""
    import numpy as np

    region = _aligned_buffer(size)
    if hugepage:
        region.madvise(mmap.MADV_HUGEPAGE)
    view = np.frombuffer(region, dtype=np.uint8)
    start = time.perf_counter()
    view[::4096] = 1
    seconds = time.perf_counter() - start
    del view
    region.close()
    return seconds


def first_touch_ceiling(size: int, hugepage: bool) -> Ceiling:
    """The best of 3 ``first_touch_seconds``."""
    seconds = min(first_touch_seconds(size, hugepage) for _ in range(3))
    name = "first_touch_hugepage" if hugepage else "first_touch"
    pages = "MADV_HUGEPAGE" if hugepage else "4 KiB pages"
    return Ceiling(name, None, gbps(size, seconds), "mmap", f"{size >> 20} MiB, {pages}, 1 thread, best of 3")


def first_touch_round(round_index: int, into: list[dict[str, Any]], size: int = FIRST_TOUCH_PROBE) -> None:
    """How fast the machine hands out fresh memory just before round ``round_index``'s loads
    (``{"round", "gbps"}`` appended to ``into``). On a VM the host backs that memory, and at times
    slowly: in the 08:41 main job of 2026-12-02 the kernel handed out ~60k pages a second for a
    minute (first touch at the end: 2.8 GB/s), and every load that faults fresh pages took 5-10x
    longer. The memory ceilings, measured last, do not see such a minute; this shows its rounds."""
    into.append({"round": round_index, "gbps": gbps(size, first_touch_seconds(size))})


# _IOWR(0xAA, 0x03, struct uffdio_copy): dst, src, len, mode (u64) and copy (s64), 40 bytes.
_UFFDIO_COPY = 0xC028AA03


def page_fill_seconds(source: Any, threads: int, fill: Any) -> float:
    """Creating ``source.nbytes`` (whole pages) of fresh 4 KiB pages holding ``source``'s bytes with
    ``UFFDIO_COPY`` on ``fill`` (a ``streamer.engine.native.PageFill``), a page-fill chunk at a
    time from ``threads`` threads taking every ``threads``-th chunk; raises OSError if the kernel
    refuses."""
    import numpy as np

    from streamer.engine.native import FILL_CHUNK

    size = source.nbytes
    region = _aligned_buffer(size)
    target = np.frombuffer(region, dtype=np.uint8)
    base, origin = target.ctypes.data, source.ctypes.data
    errors: list[OSError] = []

    def place(first: int) -> None:
        try:
            for offset in range(first * FILL_CHUNK, size, threads * FILL_CHUNK):
                length = min(FILL_CHUNK, size - offset)
                request = bytearray(struct.pack("QQQQq", base + offset, origin + offset, length, 0, 0))
                fcntl.ioctl(fill.fd, _UFFDIO_COPY, request)
        except OSError as exc:
            errors.append(exc)

    try:
        if not fill.register(base, size):
            raise OSError("UFFDIO_REGISTER refused the buffer")
        workers = [threading.Thread(target=place, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        seconds = time.perf_counter() - start
        fill.unregister(base, size)
        if errors:
            raise errors[0]
        if target[size - 1] != source[size - 1]:
            raise OSError("UFFDIO_COPY left the last page without its bytes")
        return seconds
    finally:
        del target
        region.close()


def page_fill_ceiling(size: int, repeat: int = 5) -> Ceiling:
    """The best of ``repeat`` ``page_fill_seconds`` on every usable core (of 3, it once ran below
    streamer's own warm loads); an error where the kernel (or a seccomp filter) refuses
    userfaultfd, as it refuses streamer's page fill there."""
    import numpy as np

    from streamer.engine.native import PageFill

    size -= size % mmap.PAGESIZE
    threads = len(os.sched_getaffinity(0))
    try:
        fill, refused = PageFill.open()
    except ImportError as exc:  # an engine that is not built: the loads say so, the run goes on
        return Ceiling("page_fill", None, None, "none", "", error=f"not measured: {exc}")
    if fill is None:
        return Ceiling("page_fill", None, None, "none", "", error=f"not measured: {refused}")
    source = np.ones(size, dtype=np.uint8)
    try:
        seconds = min(page_fill_seconds(source, threads, fill) for _ in range(repeat))
    except OSError as exc:
        return Ceiling("page_fill", None, None, "none", "", error=f"not measured: {exc}")
    finally:
        fill.close()
    detail = f"{size >> 20} MiB, 4 KiB pages, {threads} thread(s), best of {repeat}"
    return Ceiling("page_fill", None, gbps(size, seconds), "userfaultfd", detail)


def h2d_ceiling(size: int, device: str) -> Ceiling:
    """Pinned host buffer to ``device``, one large copy, best of 3."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    return Ceiling(
        "h2d_pinned", None, gbps(size, _best_seconds(copy)), "torch", f"{size >> 20} MiB pinned -> {device}"
    )

"""The fresh subprocess that times exactly one load (or probes, or converts) and prints one line.

Run as ``python -m streamer_bench.child '<json request>'``. Every timed load gets its own
process because loaders keep process-global state (environment variables read once, io_uring
rings, allocator pools) and because a cold start is what we measure. The line it prints starts
with ``RESULT_MARK`` so library chatter on stdout cannot be mistaken for it.

What the clock covers: from just before the loader is called until every tensor sits in memory
this process owns (or on the GPU, after a synchronize), all of them still referenced, as a
model's parameters would be. Imports, configuration objects and the CUDA context are made
before the clock.
Every run also reports the process clock: from the process's start (interpreter start, torch,
this package and the loader's imports included) to the same end, less the time spent
re-establishing the cache state and waiting out the bench's settle (``settle_until``, a
``time.monotonic()`` deadline: the load clock starts no earlier): what a cold-starting server
waits for.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamer_bench.files import remote_scheme

RESULT_MARK = "@@streamer-bench@@ "
# Comma-separated loaders, or modules a loader needs for S3, to treat as not installed (tests).
HIDE_ENV = "STREAMER_BENCH_HIDE"

Tensors = dict[str, Any]


@dataclass
class Loaded:
    """What a timed load hands back: the tensors and whatever must stay alive with them."""

    tensors: Tensors
    metrics: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    keepalive: object = None  # e.g. the buffer the tensors are views into


Prepared = Callable[[], Loaded]


def _module(name: str) -> Any:
    return importlib.import_module(name)


# --- one preparer per loader: imports and configuration here, the returned closure is timed ---


def _prepare_streamer(request: dict[str, Any]) -> Prepared:
    streamer = _module("streamer")
    source, device = request["source"], request["device"]
    concurrency = request["knobs"].get("concurrency")
    scheme = remote_scheme(source)
    knob: dict[str, Any] = {}
    if scheme is not None:  # remote reads are bounded by connections, not by local I/O threads
        section, config_type = {
            "s3": ("s3", "S3Config"),
            "gs": ("gcs", "GCSConfig"),
            "az": ("azure", "AzureConfig"),
        }[scheme]
        store: dict[str, Any] = {} if concurrency is None else {"concurrency": concurrency}
        if request["knobs"].get("crc32c") == "off":
            store["verify_crc32c"] = False
        if store:
            knob = {section: getattr(streamer, config_type)(**store)}
    elif concurrency is not None:
        knob = {"concurrency": concurrency}
    # Unlimited as streamer.load() does: everything is kept, so no limit applies.
    config = streamer.StreamerConfig(memory_limit="unlimited", **knob)

    def run_open() -> Loaded:
        # What streamer.load() does (iterate a Streamer, keep every tensor), plus its metrics.
        with streamer.open(source, device=device, config=config) as handle:
            tensors = dict(iter(handle))
            metrics = dict(handle.metrics)
        return Loaded(tensors, metrics)

    def run_load() -> Loaded:
        return Loaded(streamer.load(source, device=device, config=config))

    if request["knobs"].get("into") == "touched":
        return _into_touched(streamer, source, device, config)
    return run_load if request.get("streamer_api") == "load" else run_open


def _into_touched(streamer: Any, source: str, device: str, config: Any) -> Prepared:
    """``load_into`` of tensors allocated and written before the clock: their pages exist, so the
    clock sees the I/O path (and copies) without first touch. The shapes come from a load before
    the clock; the cache state is reached after this, so it leaves nothing behind."""
    import torch

    dest = {name: torch.empty_like(tensor, device=device) for name, tensor in streamer.load(source).items()}
    for tensor in dest.values():
        tensor.view(-1).view(torch.uint8).fill_(1)  # touched: every page faulted in and written

    def run_into() -> Loaded:
        streamer.load_into(dest, source, config=config)
        return Loaded(dest)

    return run_into


def _prepare_safetensors(request: dict[str, Any]) -> Prepared:
    st_torch = _module("safetensors.torch")
    files, device = request["files"], request["device"]
    backend = request["knobs"].get("backend", "mmap")
    kwargs = {} if backend == "mmap" else {"backend": backend}

    notes = ["mmap views cloned into owned memory"] if device == "cpu" and backend == "mmap" else []

    def load(paths: list[str]) -> Tensors:
        tensors: Tensors = {}
        for path in paths:
            if device == "cpu" and backend == "mmap":
                # load_file hands out views of a private file mapping: copy them into owned memory.
                tensors.update({k: v.clone() for k, v in st_torch.load_file(path, **kwargs).items()})
            else:
                tensors.update(st_torch.load_file(path, device=device, **kwargs))
        return tensors

    def run() -> Loaded:
        return Loaded(load(files), notes=notes)

    scheme = remote_scheme(request["source"])
    if scheme is None:
        return run
    if scheme == "s3":
        s3peers = _module("streamer_bench.s3peers")
        s3 = s3peers.client(_module("streamer.config").S3Config(), 10)

        def fetch(scratch: Path) -> list[Path]:
            return list(s3peers.download(s3, files, scratch))

        how = "boto3 download_file"
    else:
        cloudpeers = _module("streamer_bench.cloudpeers")

        def fetch(scratch: Path) -> list[Path]:
            return list(cloudpeers.download(scheme, files, scratch))

        how = "google-cloud-storage download_to_filename" if scheme == "gs" else "azure-storage-blob readinto"

    def download_and_run() -> Loaded:
        # What people do without a remote loader: download every shard, then load the local files.
        # The scratch directory goes away after the clock, with the Loaded object.
        scratch = tempfile.TemporaryDirectory(prefix="streamer-bench-download-")
        paths = fetch(Path(scratch.name))
        return Loaded(
            load([str(p) for p in paths]),
            notes=[f"{how} to {scratch.name} first", *notes],
            keepalive=scratch,
        )

    return download_and_run


def _prepare_runai(request: dict[str, Any]) -> Prepared:
    streamer_cls = _module("runai_model_streamer").SafetensorsStreamer
    files, device = request["files"], request["device"]
    # 0.17 hands out owned tensors when asked (owned=True, its default); older releases yield
    # views into a buffer they reuse, which must be cloned to be kept.
    owned = "owned" in inspect.signature(streamer_cls.stream_files).parameters

    def run() -> Loaded:
        tensors: Tensors = {}
        with streamer_cls() as streamer:
            streamer.stream_files(files, **({"owned": True} if owned else {}))
            for name, tensor in streamer.get_tensors():
                if device != "cpu":
                    tensor = tensor.to(device)
                elif not owned:
                    tensor = tensor.clone()
                tensors[name] = tensor
        return Loaded(
            tensors, notes=["owned=True tensors kept" if owned else "views cloned into owned memory"]
        )

    return run


def _prepare_fastsafetensors(request: dict[str, Any]) -> Prepared:
    fst = _module("fastsafetensors")
    files, device = request["files"], request["device"]
    threads = request["knobs"].get("concurrency")
    kwargs = {"max_threads": threads} if threads else {}

    def run() -> Loaded:
        loader = fst.SafeTensorsFileLoader(fst.SingleGroup(), device, nogds=True, **kwargs)
        loader.add_filenames({0: list(files)})
        buffer = loader.copy_files_to_device()
        tensors = {name: buffer.get_tensor(name) for name in buffer.key_to_rank_lidx}
        # Views into the loader's own anonymous (or GPU) buffer: owned memory, kept open.
        return Loaded(tensors, notes=["views into fastsafetensors' own buffer"], keepalive=(loader, buffer))

    return run


def _prepare_instanttensor(request: dict[str, Any]) -> Prepared:
    safe_open = _module("instanttensor").safe_open
    files, device = request["files"], request["device"]
    index = int(device.partition(":")[2] or 0)  # its examples pass the CUDA ordinal

    def run() -> Loaded:
        with safe_open(list(files), framework="pt", device=index) as handle:
            tensors = {name: t.clone() for name, t in handle.tensors()}
        return Loaded(tensors, notes=["views into instanttensor's reused buffer cloned"])

    return run


def _prepare_tensorizer(request: dict[str, Any]) -> Prepared:
    deserializer_cls = _module("tensorizer").TensorDeserializer
    path, device = request["files"][0], request["device"]
    readers = request["knobs"].get("concurrency")
    kwargs = {"num_readers": readers} if readers else {}

    def run() -> Loaded:
        deserializer = deserializer_cls(path, device=device, lazy_load=False, **kwargs)
        return Loaded(dict(deserializer.items()), keepalive=deserializer)

    return run


def _prepare_boto3(request: dict[str, Any]) -> Prepared:
    s3peers = _module("streamer_bench.s3peers")
    # By default as many connections as streamer opens (STREAMER_S3_CONCURRENCY is not passed down).
    config = _module("streamer.config").S3Config()
    connections = request["knobs"].get("concurrency") or config.concurrency
    torch = _module("torch")

    def run() -> Loaded:
        buffers = s3peers.ranged_get(s3peers.client(config, connections), request["files"], connections)
        objects = {
            uri: torch.frombuffer(b, dtype=torch.uint8)
            for uri, b in zip(request["files"], buffers, strict=True)
        }
        note = f"{connections} connections, {s3peers.RANGE_BYTES >> 20} MiB ranged GETs into CPU memory"
        return Loaded(objects, notes=[note], keepalive=buffers)

    return run


def _prepare_cloud_sdk(request: dict[str, Any]) -> Prepared:
    """google-cloud-storage or azure-storage-blob reading every object in parallel (``cloudpeers``)."""
    cloudpeers = _module("streamer_bench.cloudpeers")
    scheme = remote_scheme(request["source"])
    connections = request["knobs"].get("concurrency") or 16
    torch = _module("torch")

    def run() -> Loaded:
        buffers = cloudpeers.read(scheme, request["files"], connections)
        objects = {
            uri: torch.frombuffer(b, dtype=torch.uint8)
            for uri, b in zip(request["files"], buffers, strict=True)
        }
        return Loaded(objects, notes=[f"{connections} threads"], keepalive=buffers)

    return run


PREPARERS: dict[str, Callable[[dict[str, Any]], Prepared]] = {
    "streamer": _prepare_streamer,
    "safetensors": _prepare_safetensors,
    "runai": _prepare_runai,
    "fastsafetensors": _prepare_fastsafetensors,
    "instanttensor": _prepare_instanttensor,
    "tensorizer": _prepare_tensorizer,
    "boto3": _prepare_boto3,
    "gcs_sdk": _prepare_cloud_sdk,
    "azure_sdk": _prepare_cloud_sdk,
}


# --- actions ---


def _reach(state: str, files: list[str]) -> int:
    """Re-establishes the cache state right before the clock (pages come and go on shared VMs:
    this one's balloon reclaims page cache now and then); returns the bytes then resident."""
    pagecache = _module("streamer_bench.pagecache")
    paths = [Path(f) for f in files]
    if state == "cold":
        return int(pagecache.make_cold(paths))
    pagecache.make_warm(paths)
    return int(pagecache.resident_total(paths))


def _since_process_start() -> float:
    """Seconds since this process started (``/proc/self/stat`` start time; 10 ms resolution)."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    started = int(fields[19]) / ticks  # field 22 of stat(5), counted after "pid (comm)"
    with open("/proc/uptime") as uptime:
        return float(uptime.read().split()[0]) - started


def machine_cpu_ticks() -> tuple[int, int] | None:
    """The whole machine's CPU time so far, every process and the kernel (``/proc/stat``, in clock
    ticks): busy (user, nice, system, irq, softirq) and stolen by the hypervisor. None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, steal


def machine_cores(
    before: tuple[int, int] | None, after: tuple[int, int] | None, seconds: float
) -> tuple[float, float] | None:
    """Cores the machine kept busy, and cores the hypervisor took, on average over ``seconds``: what
    a load's own CPU seconds cannot show (a local S3 server's share of the same cores)."""
    if before is None or after is None or seconds <= 0:
        return None
    ticks = os.sysconf("SC_CLK_TCK") * seconds
    return (after[0] - before[0]) / ticks, (after[1] - before[1]) / ticks


def _peak_rss() -> int:
    """This process's own high-water mark of resident memory (``VmHWM``): ``ru_maxrss`` carries the
    parent's across fork and exec, so every child reported the bench's own (~430 MiB)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # not Linux: the best known


def _tensor_bytes(tensors: Tensors) -> tuple[int, int]:
    return sum(t.numel() * t.element_size() for t in tensors.values()), len(tensors)


def _create_cuda_context(device: str) -> None:
    """Makes the device's CUDA context before the clock: a server has one before it loads weights,
    and its creation (~0.3-0.5 s) would otherwise be timed as part of every GPU loader's load."""
    import torch

    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)


def time_load(request: dict[str, Any]) -> dict[str, Any]:
    """Times one load; ``cache`` (cold|warm) is re-established and measured just before the clock."""
    import torch

    device = request["device"]
    prepared = PREPARERS[request["loader"]](request)
    if device.startswith("cuda"):
        _create_cuda_context(device)
    settling = time.perf_counter()
    time.sleep(max(0.0, request.get("settle_until", 0.0) - time.monotonic()))  # the parent's settle
    settle_seconds = time.perf_counter() - settling
    reaching = time.perf_counter()
    resident = _reach(request["cache"], request["files"]) if request.get("cache") else None
    reach_seconds = time.perf_counter() - reaching
    rss_before = _peak_rss()
    usage_before = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    machine_before = machine_cpu_ticks()
    start = time.perf_counter()
    loaded = prepared()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    machine = machine_cores(machine_before, machine_cpu_ticks(), seconds)
    process_seconds = _since_process_start() - reach_seconds - settle_seconds
    usage = resource.getrusage(resource.RUSAGE_SELF)
    nbytes, count = _tensor_bytes(loaded.tensors)
    result = {
        "seconds": seconds,
        "process_seconds": process_seconds,
        "bytes": nbytes,
        "tensors": count,
        "peak_rss_bytes": _peak_rss(),
        "rss_before_bytes": rss_before,
        "minor_faults": usage.ru_minflt - usage_before.ru_minflt,
        "cpu_seconds": usage.ru_utime + usage.ru_stime - usage_before.ru_utime - usage_before.ru_stime,
        "machine_busy_cores": machine[0] if machine else None,
        "machine_stolen_cores": machine[1] if machine else None,
        "resident_at_start_bytes": resident,
        "metrics": loaded.metrics,
        "notes": loaded.notes,
    }
    del loaded
    return result


def _importable(module: str, hidden: set[str]) -> bool:
    if module in hidden:
        return False
    try:
        _module(module)
    except Exception:  # missing or broken: either way it cannot read S3 here
        return False
    return True


def probe(request: dict[str, Any]) -> dict[str, Any]:
    """Which loaders import here, their versions and features (``remote_missing``: the modules
    the source's store needs that do not import), and what CUDA offers."""
    from importlib import metadata

    hidden = {h.strip() for h in os.environ.get(HIDE_ENV, "").split(",") if h.strip()}
    loaders: dict[str, Any] = {}
    for name, module in request["modules"].items():
        entry: dict[str, Any] = {"available": False, "reason": None, "version": None, "features": {}}
        loaders[name] = entry
        if name in hidden:
            entry["reason"] = f"not installed (hidden by {HIDE_ENV})"
            continue
        try:
            mod = _module(module)
            if name == "streamer":
                _module("streamer_bench.pagecache")
                if not callable(getattr(mod, "load", None)):
                    raise ImportError("streamer.load is missing")
            if name == "safetensors":
                sig = inspect.signature(_module("safetensors.torch").load_file)
                entry["features"]["pread_backend"] = "backend" in sig.parameters
        except ModuleNotFoundError as exc:
            entry["reason"] = "not installed" if exc.name and module.startswith(exc.name) else repr(exc)
            continue
        except Exception as exc:  # a broken install is reported, never fatal
            entry["reason"] = f"import failed: {exc!r}"[:500]
            continue
        entry["available"] = True
        entry["features"]["remote_missing"] = [
            m for m in request["remote_modules"].get(name, []) if not _importable(m, hidden)
        ]
        entry["version"] = getattr(mod, "__version__", None)
        for dist in request["distributions"].get(name, []):
            try:
                entry["version"] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    import torch

    cuda = torch.cuda.is_available()
    return {
        "loaders": loaders,
        "torch": torch.__version__,
        "cuda": {
            "available": cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if cuda
            else [],
            "version": torch.version.cuda,
        },
    }


def convert_tensorizer(request: dict[str, Any]) -> dict[str, Any]:
    """Writes all shards into one tensorizer file (done once, never timed)."""
    st_torch = _module("safetensors.torch")
    serializer_cls = _module("tensorizer").TensorSerializer
    tensors: Tensors = {}
    for path in request["files"]:
        tensors.update(st_torch.load_file(path))
    tmp = request["out"] + ".partial"
    serializer = serializer_cls(tmp)
    serializer.write_state_dict(tensors)
    serializer.close()
    os.replace(tmp, request["out"])
    return {"path": request["out"]}


ACTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "load": time_load,
    "probe": probe,
    "convert_tensorizer": convert_tensorizer,
}


def main(argv: list[str]) -> int:
    request = json.loads(argv[1])
    try:
        result = {"ok": True} | ACTIONS[request["action"]](request)
    except BaseException as exc:  # the parent reports whatever went wrong
        result = {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc(),
        }
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))

"""``streamer-bench``: time loaders from a cold (and/or warm) page cache, or from S3, side by side.

The phases, in order: get a checkpoint (``--source`` or ``--synthetic``), probe which loaders
are installed (in a child, like the runs), convert for tensorizer once, then per cache state:
read ceilings, then ``--repeat`` interleaved rounds over every loader setting, each run in a
fresh process. Memory ceilings last; then the table, ``--json`` and ``--plot``.

An ``s3://`` source has one state, "remote": there is no page cache on this machine to empty or
fill, so ``--cold``/``--warm`` are refused rather than given a meaning they cannot have. Its
ceiling is the boto3 loader (plain ranged GETs through the same endpoint), run interleaved with
the others; the local read ceilings do not apply.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from streamer_bench import ceilings, pagecache, report, runner, synthetic
from streamer_bench.arguments import parse_args
from streamer_bench.facts import facts, s3_endpoint
from streamer_bench.files import CheckpointFiles, SourceProblem, SourceUnreachable, resolve
from streamer_bench.loaders import (
    ALL_LOADERS,
    BASELINE,
    INTO_SETTING,
    LOADERS,
    Setting,
    settings_for,
)
from streamer_bench.units import format_bytes

DISTRIBUTIONS = {
    "streamer": ["streamer-weights"],
    "safetensors": ["safetensors"],
    "runai": ["runai-model-streamer"],
    "fastsafetensors": ["fastsafetensors"],
    "instanttensor": ["instanttensor"],
    "tensorizer": ["tensorizer"],
    "boto3": ["boto3"],
}


# --- phases ---


class Progress:
    """Progress lines on stderr; a live percentage when stderr is a terminal."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last = -1

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.start:7.1f}s] {message}", file=sys.stderr, flush=True)

    def bar(self, what: str, done: int, total: int) -> None:
        percent = done * 100 // max(total, 1)
        if self.quiet or percent == self._last or (not self.tty and percent % 25 and done < total):
            return
        self._last = percent
        filled = percent // 4
        end = "\n" if done >= total or not self.tty else ""
        print(
            f"\r{what} [{'#' * filled}{'.' * (25 - filled)}] {percent:3d}%",
            end=end,
            file=sys.stderr,
            flush=True,
        )


def obtain_checkpoint(
    args: argparse.Namespace, workdir: Path, progress: Progress
) -> tuple[CheckpointFiles, dict[str, Any] | None]:
    if args.source is not None:
        return resolve(args.source), None
    target = (args.keep or workdir) / f"synthetic-{args.synthetic}-{args.shards}"
    what = f"generating {format_bytes(args.synthetic)} checkpoint in {target}"
    made = synthetic.generate(
        target, args.synthetic, args.shards, progress=lambda d, t: progress.bar(what, d, t)
    )
    if made.reused:
        progress(f"reusing the checkpoint in {target}")
    info = {
        "requested_bytes": args.synthetic,
        "shards": len(made.files),
        "reused": made.reused,
        "shape": made.shape.__dict__,
        "generator_version": synthetic.GENERATOR_VERSION,
    }
    if args.upload is None:
        return resolve(str(made.index)), info
    progress(f"uploading the checkpoint to {args.upload} (objects of the right size are kept)")
    try:
        uris = _upload(args.scheme, [*made.files, made.index], args.upload)
    except Exception as exc:  # the endpoint, the credentials or the bucket: say which, briefly
        raise SourceUnreachable(f"uploading to {args.upload} failed: {type(exc).__name__}: {exc}") from None
    return resolve(uris[-1]), info


def _upload(scheme: str, files: list[Path], prefix: str) -> list[str]:
    if scheme == "s3":
        from streamer.config import S3Config
        from streamer_bench import s3peers

        return s3peers.upload(s3peers.client(S3Config(), 10), files, prefix)
    from streamer_bench import cloudpeers

    return cloudpeers.upload(scheme, files, prefix)


def probe(scheme: str | None) -> dict[str, Any]:
    """What is installed, probed in a child like the runs; a store's modules only for its sources."""
    remote_modules = {
        name: LOADERS[name].remote[scheme].modules
        for name in ALL_LOADERS
        if scheme is not None and scheme in LOADERS[name].remote
    }
    result = runner.call_child(
        {
            "action": "probe",
            "modules": {name: LOADERS[name].module for name in ALL_LOADERS},
            "remote_modules": remote_modules,
            "distributions": DISTRIBUTIONS,
        },
        timeout=600,
    )
    if not result["ok"]:
        raise RuntimeError(f"probing the loaders failed: {result['error']}")
    return result


def tensorizer_file(checkpoint: CheckpointFiles, workdir: Path, progress: Progress) -> str:
    """Converts the checkpoint once (untimed); reused from --keep when newer than the shards."""
    out = workdir / "tensorizer" / "model.tensors"
    newest = max(f.stat().st_mtime for f in checkpoint.files)
    if out.is_file() and out.stat().st_mtime >= newest:
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    progress("converting the checkpoint for tensorizer (once, not timed)")
    result = runner.call_child(
        {"action": "convert_tensorizer", "files": [str(f) for f in checkpoint.files], "out": str(out)}
    )
    if not result["ok"]:
        raise RuntimeError(f"tensorizer conversion failed: {result['error']}")
    return str(out)


def _source_mismatch(name: str, scheme: str | None) -> str | None:
    """Why loader ``name`` cannot read this kind of source, if it cannot."""
    info = LOADERS[name]
    if info.reference_of is not None and scheme != info.reference_of:
        own = "the store's own reads; local sources get the read ceilings"
        return f"{info.reference_of}:// sources only ({own})"
    if scheme is not None and scheme not in info.remote:
        return "local files only" if not info.remote else f"not {scheme}:// sources"
    return None


def plan(
    args: argparse.Namespace,
    checkpoint: CheckpointFiles,
    probed: dict[str, Any],
    workdir: Path,
    progress: Progress,
) -> tuple[list[tuple[Setting, list[str]]], list[dict[str, str | None]]]:
    """Which settings run and on which files; which loaders are skipped and why."""
    concurrency = args.sweep[1] if args.sweep else []
    runs: list[tuple[Setting, list[str]]] = []
    skipped: list[dict[str, str | None]] = []
    for name in args.loaders:
        info, state = LOADERS[name], probed["loaders"][name]
        mismatch = _source_mismatch(name, checkpoint.scheme)
        if mismatch is not None:
            skipped.append({"loader": name, "reason": mismatch, "install": None})
            continue
        if info.cuda_only and not args.device.startswith("cuda"):
            reason = f"CUDA only, not run for device {args.device}"
            skipped.append({"loader": name, "reason": reason, "install": None})
            continue
        if not state["available"]:
            skipped.append({"loader": name, "reason": state["reason"], "install": info.pip})
            continue
        missing = state["features"].get("remote_missing")
        if checkpoint.scheme is not None and missing:
            reason = f"{checkpoint.scheme}:// support not installed ({', '.join(missing)} does not import)"
            skipped.append({"loader": name, "reason": reason, "install": info.remote[checkpoint.scheme].pip})
            continue
        backends = list(args.safetensors_backends)
        if name == "safetensors" and not state["features"].get("pread_backend"):
            backends = [b for b in backends if b != "pread"] or ["mmap"]
        files = list(checkpoint.shards)
        if name == "tensorizer":
            try:
                files = [tensorizer_file(checkpoint, args.keep or workdir, progress)]
            except RuntimeError as exc:
                skipped.append({"loader": name, "reason": str(exc)[:500], "install": None})
                continue
        into = args.into_touched and not checkpoint.remote
        unchecked = checkpoint.scheme == "gs"
        for setting in settings_for(
            name, concurrency, args.runai_strategies, backends, into_touched=into, unchecked=unchecked
        ):
            runs.append((setting, files))
    if args.baseline is not None:
        runs.append((Setting(BASELINE, python=args.baseline), list(checkpoint.shards)))
    return runs, skipped


def state_runs(
    args: argparse.Namespace, planned: list[tuple[Setting, list[str]]], state: str
) -> list[tuple[Setting, list[str]]]:
    """The planned runs a cache state times: 'into=touched' only cold, unless asked for warm too."""
    wanted = state == "cold" or args.into_touched_warm
    return [(setting, files) for setting, files in planned if setting != INTO_SETTING or wanted]


# What --time-budget keeps back for what follows the state in progress, from the main job's log
# (1 GiB checkpoint, 2-core VM): one fio run of a storage ceiling, its cache state reset included,
# ~1.5 s, and a buffered cold one waits the settle first; the memory ceilings at the end ~10 s. A
# later state's run is taken to cost what one of the state in progress does: warm runs (after cold)
# came 3.5-12 s apart in the jobs of 2026-12-02, cold ones 4-7 s.
FIO_RUN_SECONDS = 1.5
MEMORY_CEILINGS_SECONDS = 10.0


def ceiling_seconds(args: argparse.Namespace, state: str) -> float:
    """What a state's storage ceilings take: every reader count of every mode, each
    ``--ceiling-repeat`` times, and for cold one more before each of its minimum rounds (the
    buffered read, the best on our VMs, so each of those waits the settle too)."""
    if not args.ceilings or state == "remote":
        return 0.0
    per_mode = len(ceilings.JOB_COUNTS) * int(args.ceiling_repeat)
    if state != "cold":
        return per_mode * FIO_RUN_SECONDS
    buffered = per_mode + int(args.min_rounds)
    return (buffered + per_mode) * FIO_RUN_SECONDS + buffered * float(args.settle)


def time_budget(
    args: argparse.Namespace, start: float, planned: list[tuple[Setting, list[str]]], later: list[str]
) -> runner.TimeBudget | None:
    """The budget a state runs under: --time-budget from the bench's ``start``, less the minimum
    rounds of the ``later`` states (in runs of the state in progress) and the ceilings still to
    measure."""
    if args.time_budget is None:
        return None
    later_runs = sum(args.min_rounds * len(state_runs(args, planned, state)) for state in later)
    reserve = 0.0
    if args.ceilings:
        reserve = sum(ceiling_seconds(args, state) for state in later) + MEMORY_CEILINGS_SECONDS
    return runner.TimeBudget(start + args.time_budget, later_runs, reserve)


def run_sections(
    args: argparse.Namespace,
    checkpoint: CheckpointFiles,
    planned: list[tuple[Setting, list[str]]],
    progress: Progress,
    sections: list[dict[str, Any]],
) -> None:
    """Appends one section per cache state to ``sections``, in ``args.states``' order; on
    ``runner.Interrupted`` the state in progress is appended with the runs it finished before the
    exception goes on."""
    for i, state in enumerate(args.states):
        found: list[ceilings.Ceiling] = []
        touches: list[dict[str, Any]] = []
        runs = state_runs(args, planned, state)
        configs = [runner.Config(setting, files, checkpoint.source) for setting, files in runs]
        try:
            if args.ceilings and state != "remote":

                def prepare(state: str = state) -> None:
                    if state == "cold" and pagecache.make_cold(checkpoint.files):
                        raise pagecache.CacheStateError("eviction left pages resident")
                    if state == "warm" and pagecache.make_warm(checkpoint.files):
                        raise pagecache.CacheStateError("files could not be fully cached")

                modes = ("buffered", "direct") if state == "cold" else ("buffered",)
                found = ceilings.storage_ceilings(
                    checkpoint.files,
                    state,
                    prepare,
                    modes=modes,
                    use_fio=args.fio,
                    repeat=args.ceiling_repeat,
                    settle=args.settle,
                    progress=progress,
                )
            each_round = None
            if args.ceilings and state != "remote":
                reads = [c for c in found if c.name in ("read_buffered", "read_direct") and c.gbps]
                each_round = functools.partial(
                    _before_round,
                    # cold reads drift most: each round gets its own read ceiling
                    max(reads, key=lambda c: c.gbps or 0.0) if state == "cold" and reads else None,
                    checkpoint.files,
                    prepare,
                    touches,
                    settle=args.settle,
                    progress=progress,
                )
            stopped = runner.run_section(
                configs,
                state,
                args.repeat,
                device=args.device,
                streamer_api=args.streamer_api,
                timeout=args.timeout,
                progress=progress,
                clock=args.clock,
                settle=args.settle,
                min_rounds=args.min_rounds,
                undecided=functools.partial(report.undecided, state, configs),
                prune_after=args.prune_after,
                each_round=each_round,
                budget=time_budget(args, progress.start, planned, args.states[i + 1 :]),
            )
            if args.ceilings and state == "remote":
                found = ceilings.remote_ceilings(
                    checkpoint.scheme or "s3",
                    [c for c in configs if LOADERS[c.setting.child_loader].reference_of == checkpoint.scheme],
                )
        except runner.Interrupted as stop:
            stop.during = f"{state} runs"
            if any(c.runs for c in configs):
                sections.append(report.section(state, configs, found, touches))
            raise
        sections.append({**report.section(state, configs, found, touches), "stopped": stopped})


def _before_round(
    read_ceiling: ceilings.Ceiling | None,
    files: Sequence[Path],
    prepare: Callable[[], None],
    touches: list[dict[str, Any]],
    round_index: int,
    settle: float,
    progress: Progress,
) -> None:
    """What is measured again before each round's loads: the read ceiling (cold), then how fast
    the machine hands out fresh memory."""
    if read_ceiling is not None:
        ceilings.measure_round(read_ceiling, files, prepare, round_index, settle=settle, progress=progress)
    ceilings.first_touch_round(round_index, touches)


def flush_writeback(progress: Progress) -> None:
    """Writes the machine's dirty pages out (sync(2)) before the first timed run.

    What was written just before, such as the main job's ~1 GB install, is otherwise written back
    about 30 s later (``vm.dirty_expire_centisecs``), through the first rounds: after copying that
    install, 1 GiB warm loads 3 s apart took 2.09, 0.85, 1.35, 1.02 s (at 2x their CPU seconds)
    for ~40 s; after a sync (0.9 s), 0.18-0.35 s from the first (2-core VM, 2026-12-02).
    """
    started = time.monotonic()
    os.sync()
    progress(f"wrote the machine's dirty pages out (sync) in {time.monotonic() - started:.1f} s")


def measure(
    args: argparse.Namespace,
    checkpoint: CheckpointFiles,
    planned: list[tuple[Setting, list[str]]],
    probed: dict[str, Any],
    progress: Progress,
) -> tuple[list[dict[str, Any]], list[ceilings.Ceiling], runner.Interrupted | None]:
    """Every section's runs, then the memory ceilings; what was measured before a SIGINT or SIGTERM
    (and which signal), if one came."""
    sections: list[dict[str, Any]] = []
    memory: list[ceilings.Ceiling] = []
    try:
        flush_writeback(progress)
        run_sections(args, checkpoint, planned, progress, sections)
        memory = memory_ceilings(args, checkpoint, probed, progress)
    except runner.Interrupted as stop:
        stop.during = stop.during or "memory ceilings"  # run_sections names a state it cut short
        progress(f"{stop.signal}: stopped; reporting the runs that finished")
        return sections, memory, stop
    return sections, memory, None


def memory_ceilings(
    args: argparse.Namespace, checkpoint: CheckpointFiles, probed: dict[str, Any], progress: Progress
) -> list[ceilings.Ceiling]:
    if not args.ceilings:
        return []
    size = min(max(checkpoint.tensor_bytes, 64 << 20), 1 << 30)
    progress(f"memory ceilings ({format_bytes(size)} buffers)")
    out = [
        ceilings.memcpy_ceiling(size),
        ceilings.first_touch_ceiling(size, False),
        ceilings.first_touch_ceiling(size, True),
        ceilings.page_fill_ceiling(size),
    ]
    if args.device.startswith("cuda") and probed["cuda"]["available"]:
        out.append(ceilings.h2d_ceiling(size, args.device))
    return out


def document(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    checkpoint: CheckpointFiles,
    synthetic_info: dict[str, Any] | None,
    probed: dict[str, Any],
    skipped: list[dict[str, str | None]],
    sections: list[dict[str, Any]],
    memory: list[ceilings.Ceiling],
) -> dict[str, Any]:
    """The JSON document (``schema.json``)."""
    return {
        "schema": report.SCHEMA_ID,
        "command": ["streamer-bench", *(sys.argv[1:] if argv is None else argv)],
        "machine": facts(
            None if checkpoint.remote else checkpoint.files[0],
            probed,
            s3_endpoint() if checkpoint.scheme == "s3" else None,
        ),
        "checkpoint": {
            "source": checkpoint.source,
            "synthetic": synthetic_info,
            "kept": bool(args.keep) or synthetic_info is None,
            "files": [{"path": path, "bytes": size} for path, size in checkpoint.shards.items()],
            "tensor_bytes": checkpoint.tensor_bytes,
            "tensor_count": checkpoint.tensor_count,
        },
        "options": {
            "loaders": args.loaders,
            "baseline": args.baseline,
            "device": args.device,
            "repeat": args.repeat,
            "min_rounds": args.min_rounds,
            "time_budget_seconds": args.time_budget,
            "ceiling_repeat": args.ceiling_repeat,
            "clock": args.clock,
            "settle_seconds": args.settle,
            "cold": args.cold,
            "warm": args.warm,
            "sweep": dict([args.sweep]) if args.sweep else {},
            "runai_strategies": args.runai_strategies,
            "safetensors_backends": args.safetensors_backends,
            "streamer_api": args.streamer_api,
            "read_ceiling_tool": "fio" if args.fio and shutil.which("fio") else "python",
        },
        "skipped": skipped,
        "sections": sections,
        "memory_ceilings": [asdict(c) for c in memory],
    }


def _rank_bench(args: argparse.Namespace, checkpoint: CheckpointFiles, progress: Progress) -> int:
    from streamer_bench import ranks

    keep = args.streamer_api == "load"
    doc = ranks.bench(checkpoint, args.ranks, args.repeat, args.states, progress, keep=keep)
    print(ranks.render(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["vllm"]:  # the vLLM cold-start subcommand (benchmarks/streamer_bench/vllm_bench.py)
        from streamer_bench.vllm_bench import main as vllm_main

        return vllm_main(given[1:])
    args = parse_args(argv)
    progress = Progress(args.quiet)
    try:
        with runner.stopping_on_signals():
            return _bench(args, argv, progress)
    except runner.Interrupted as stop:  # before any run: nothing to report; the temporary files are gone
        print(f"streamer-bench: stopped by {stop.signal} before any run", file=sys.stderr)
        return stop.exit_status


def _bench(args: argparse.Namespace, argv: Sequence[str] | None, progress: Progress) -> int:
    """Everything after the arguments: the checkpoint, the runs, the report and its files."""
    with tempfile.TemporaryDirectory(prefix="streamer-bench-") as tmp:
        workdir = Path(tmp)
        probed = probe(args.scheme)
        if args.device.startswith("cuda") and not probed["cuda"]["available"]:
            args.parser.error(f"--device {args.device}: torch reports no CUDA device here")
        try:
            checkpoint, synthetic_info = obtain_checkpoint(args, workdir, progress)
        except SourceProblem as exc:
            args.parser.error(str(exc))
        except SourceUnreachable as exc:
            print(f"streamer-bench: error: {exc}", file=sys.stderr)
            return 1
        try:
            if not checkpoint.remote:
                pagecache.resident_total(checkpoint.files)
        except pagecache.CacheStateError as exc:
            print(f"streamer-bench: error: {exc}", file=sys.stderr)
            return 1
        if args.ranks is not None:
            return _rank_bench(args, checkpoint, progress)
        planned, skipped = plan(args, checkpoint, probed, workdir, progress)
        for s in skipped:
            progress(f"skipping {s['loader']}: {s['reason']}")
        sections, memory, stopped = measure(args, checkpoint, planned, probed, progress)
        doc = document(args, argv, checkpoint, synthetic_info, probed, skipped, sections, memory)
        if stopped is not None:
            doc["interrupted"] = {"signal": stopped.signal, "during": stopped.during}
    print(report.render(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if args.plot is not None:
        from streamer_bench.plot import plot

        plot(doc, args.plot)
        progress(f"wrote {args.plot}")
    if args.prometheus_textfile is not None:
        from streamer_bench import textfile

        textfile.write(doc, args.prometheus_textfile)
        progress(f"wrote {args.prometheus_textfile}")
    if stopped is not None:
        return stopped.exit_status
    measured = any(r["status"] == "ok" for sec in sections for r in sec["results"])
    return 0 if measured or not planned else 1

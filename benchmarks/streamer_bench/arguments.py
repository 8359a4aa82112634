"""``streamer-bench``'s command line: every option, its parsing and its checks (a bad value is a
usage error, exit status 2, before anything runs)."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamer_bench import runner, stats
from streamer_bench.files import SourceProblem, remote_scheme
from streamer_bench.loaders import (
    ALL_LOADERS,
    RUNAI_DEFAULT_STRATEGY,
    RUNAI_STRATEGIES,
    SAFETENSORS_BACKENDS,
    default_loaders,
)
from streamer_bench.units import nonnegative_seconds, parse_size, positive_int

DEFAULT_SYNTHETIC = "1GiB"
# Paired per-round ratios on these VMs spread ~15% around their median: 10 rounds bound the
# median's 95% interval to about ±10%, enough to call a 15-20% lead (see benchmarks/streamer_bench/stats.py).
DEFAULT_REPEAT = 10
# Rounds before a peer's slow settings stop (runner.prune): in the main job's runs on this VM the
# settings it drops (safetensors' pread, Run:ai's default strategy) were 1.5-2.6x their loader's
# best from the first round on, while a loader's settings within 1.4x of each other swap places.
PRUNE_AFTER = 2
SWEEPABLE = ("concurrency",)


# --- argument parsing: every bad value is a usage error (exit status 2) ---


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _choices(allowed: Sequence[str], what: str) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in allowed]
        if not items or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown) or repr(text)}; choose from {', '.join(allowed)}"
            )
        return list(dict.fromkeys(items))

    return parse


def _strategies(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if not re.fullmatch(r"[a-z_]+", t)]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"bad strategy list {text!r} (example: default,sync_buffered)")
    return list(dict.fromkeys(items))


def _sweep(text: str) -> tuple[str, list[int]]:
    key, sep, values = text.partition("=")
    if not sep or key.strip() not in SWEEPABLE:
        raise argparse.ArgumentTypeError(f"expected {'|'.join(SWEEPABLE)}=N,N,…, got {text!r}")
    try:
        numbers = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"sweep values must be integers, got {values!r}") from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"sweep values must be positive integers, got {values!r}")
    return key.strip(), list(dict.fromkeys(numbers))


def _budget(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (or 'none')") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a budget is more than 0 seconds")
    return seconds


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda:N, got {text!r}")
    return "cuda:0" if text == "cuda" else text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamer-bench",
        description="Cold-start load times of safetensors loaders, each run in a fresh process, "
        "with verified page-cache eviction, interleaved repetitions and hardware ceilings.",
        epilog="examples: streamer-bench --synthetic 4GiB --cold --warm --sweep concurrency=1,4,16; "
        "AWS_ENDPOINT_URL=http://127.0.0.1:9000 streamer-bench --source s3://bucket/model/ "
        "(credentials, region and endpoint from the standard AWS variables); "
        "STORAGE_EMULATOR_HOST=http://127.0.0.1:4443 streamer-bench --source gs://bucket/model/; "
        "vLLM cold starts per load format: streamer-bench vllm --help",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--source",
        metavar="PATH|URI",
        help="a .safetensors file, a directory of them, or a model.safetensors.index.json; local "
        "or remote (s3://bucket/prefix/, s3://bucket/key.safetensors, s3://bucket/…/index.json; "
        "gs://… and az://… alike), with the endpoint and credentials streamer's configuration "
        "takes from the environment (AWS_*, STORAGE_EMULATOR_HOST or GOOGLE_*, AZURE_STORAGE_*)",
    )
    src.add_argument(
        "--synthetic",
        metavar="SIZE",
        type=_size,
        help=f"generate a Llama-like bf16 checkpoint of SIZE (e.g. 4GiB; default {DEFAULT_SYNTHETIC})",
    )
    p.add_argument("--shards", type=positive_int, help="files of the synthetic checkpoint (default 2)")
    p.add_argument(
        "--upload",
        metavar="URI",
        help="with --synthetic: put the generated checkpoint under this prefix (s3://BUCKET/PREFIX/, "
        "gs://…, az://CONTAINER/PREFIX/; the endpoint and credentials as for --source; objects "
        "already there with the right size are kept) and benchmark it from there",
    )
    p.add_argument(
        "--keep",
        metavar="DIR",
        type=Path,
        help="generate into (or reuse from) DIR/synthetic-SIZE-SHARDS and keep it; tensorizer's converted "
        "file is kept there too",
    )
    p.add_argument(
        "--loaders",
        type=_choices(ALL_LOADERS, "loader"),
        help=f"comma-separated from {','.join(ALL_LOADERS)}; default: all (boto3, plain ranged GETs, "
        "is the S3 ceiling: by default only for S3 sources)",
    )
    p.add_argument("--device", type=_device, default="cpu", help="cpu (default) or cuda:N")
    p.add_argument(
        "--cold",
        action="store_true",
        help="evict the files before every run and verify 0 bytes resident (neither flag: both; "
        "not for S3 sources, timed in the 'remote' state)",
    )
    p.add_argument(
        "--warm",
        action="store_true",
        help="have the files fully cached before every run (verified; not for S3 sources)",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=DEFAULT_REPEAT,
        help=f"the most rounds per cache state: runs per setting, interleaved (default {DEFAULT_REPEAT}); "
        "a state ends sooner, after --min-rounds, once every verdict against a peer is decided",
    )
    p.add_argument(
        "--min-rounds",
        type=positive_int,
        default=stats.MIN_ROUNDS,
        help=f"rounds a cache state runs before it may end early (default {stats.MIN_ROUNDS}, the fewest "
        "a paired verdict needs); set it to --repeat for a fixed number of rounds",
    )
    p.add_argument(
        "--time-budget",
        type=_budget,
        metavar="S",
        help="seconds the bench should take (from its start): past --min-rounds, a cache state starts "
        "another round only if it and the later states' minimum rounds fit; a verdict left undecided "
        "says so. 'none' (the default): no budget",
    )
    p.add_argument(
        "--settle",
        type=nonnegative_seconds,
        default=runner.default_settle(),
        metavar="S",
        help=f"seconds between a run and the next (default {runner.DEFAULT_SETTLE:g} on a VM with free page "
        "reporting, so every run meets memory the host took back, as a server starting on an idle "
        "node does; else 0)",
    )
    p.add_argument(
        "--ceiling-repeat",
        type=positive_int,
        default=2,
        help="runs per reader count of the storage ceilings (default 2; the ceiling is the best median; "
        "the cold one is measured again before every round, for the ratio paired by round)",
    )
    p.add_argument(
        "--sweep",
        type=_sweep,
        metavar="concurrency=N,N,…",
        help="extra settings for loaders with a concurrency knob, besides their default: streamer "
        "StreamerConfig.concurrency (S3Config.concurrency for s3://), runai RUNAI_STREAMER_CONCURRENCY, "
        "fastsafetensors max_threads, tensorizer num_readers, boto3 connections",
    )
    p.add_argument(
        "--runai-strategies",
        type=_strategies,
        default=list(RUNAI_STRATEGIES),
        help="RUNAI_STREAMER_FS_STRATEGY values ('default' = unset: io_uring + O_DIRECT); "
        "default: default,sync_buffered; S3 sources: default only (a file-system knob)",
    )
    p.add_argument(
        "--no-into-touched",
        dest="into_touched",
        action="store_false",
        help="skip streamer's 'into=touched' row: load_into of destination tensors allocated and touched "
        "before the clock (what a reloaded model sees), the I/O path measured against the read ceiling",
    )
    p.add_argument(
        "--into-touched-warm",
        action="store_true",
        help="time the 'into=touched' row warm too (by default cold only, where it shows the I/O path)",
    )
    p.add_argument(
        "--safetensors-backends",
        type=_choices(SAFETENSORS_BACKENDS, "backend"),
        help="load_file backends: mmap (views, cloned) and pread (owned); default: mmap into CPU "
        "memory (pread was never its best there: 1.1x mmap's time cold, 2.5x warm, on a 2-core VM), "
        "both into a GPU (pread was its best cold on an H200 host)",
    )
    p.add_argument(
        "--streamer-api",
        choices=("open", "load"),
        default="open",
        help="open (default): iterate streamer.open() into a dict, as load() does, and record its "
        "metrics; load: time streamer.load() itself (no metrics). With --ranks: open streams (each "
        "tensor dropped as it comes), load keeps every tensor on every rank, as load() does",
    )
    p.add_argument(
        "--clock",
        choices=("load", "process"),
        default="load",
        help="what a run's seconds are: load (default), from calling the loader until every tensor "
        "is in owned memory; process, from the child process's start, interpreter, torch and the "
        "loader's imports included (a server's cold start; fixed costs weigh more). Both are recorded",
    )
    p.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="also time streamer as PYTHON has it installed (e.g. a venv of the previous commit, "
        "`.../bin/python`), as loader 'baseline' at its default, paired by round like a peer: "
        "an A/B of two versions in one run",
    )
    p.add_argument(
        "--prune-after",
        type=positive_int,
        default=PRUNE_AFTER,
        metavar="N",
        help=f"after N rounds (default {PRUNE_AFTER}), stop running a peer's settings that are over "
        f"{runner.PRUNE_MARGIN:g}x slower than its best (the verdicts compare each peer at its best)",
    )
    p.add_argument(
        "--no-prune",
        dest="prune_after",
        action="store_const",
        const=None,
        help="run every setting every round",
    )
    p.add_argument("--json", metavar="FILE", type=Path, help="write every run and fact (schema.json) to FILE")
    p.add_argument(
        "--plot", metavar="FILE.png", type=Path, help="bar chart with whiskers and ceilings (matplotlib)"
    )
    p.add_argument(
        "--prometheus-textfile",
        metavar="FILE.prom",
        type=Path,
        help="write the results as Prometheus gauges for the node exporter's textfile collector",
    )
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false", help="skip the reference ceilings")
    p.add_argument(
        "--no-fio",
        dest="fio",
        action="store_false",
        help="measure read ceilings in Python even if fio exists",
    )
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=1800,
        metavar="S",
        help="seconds one run may take (default 1800)",
    )
    p.add_argument(
        "--ranks",
        type=positive_int,
        metavar="N",
        help="N processes in a gloo group (group=) against the same N loading independently, "
        "interleaved; replaces the loader comparison (benchmarks/streamer_bench/ranks.py)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = args.upload if args.upload is not None else args.source
    try:
        scheme = remote_scheme(given) if given is not None else None
    except SourceProblem as refused:
        parser.error(str(refused))
    if args.upload is not None and (args.source is not None or scheme is None or given.startswith("https")):
        parser.error("--upload takes an s3://, gs:// or az:// prefix and goes with --synthetic, not --source")
    remote = scheme is not None
    if remote and (args.cold or args.warm):
        parser.error(
            f"--{'cold' if args.cold else 'warm'} does not apply to a remote source: there is no page "
            "cache on this machine to evict or fill (remote runs are timed in the 'remote' state)"
        )
    if args.source is not None and args.shards is not None:
        parser.error("--shards only applies to --synthetic")
    args.shards = args.shards or 2
    args.min_rounds = min(args.min_rounds, args.repeat)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib (or the bench's [plot] extra)")
    if args.prometheus_textfile is not None and importlib.util.find_spec("prometheus_client") is None:
        parser.error("--prometheus-textfile needs prometheus-client: pip install prometheus-client")
    args.remote = remote
    args.scheme = scheme
    if remote:
        args.states = ["remote"]
        args.runai_strategies = [RUNAI_DEFAULT_STRATEGY]
    else:
        if not args.cold and not args.warm:
            args.cold = args.warm = True
        # Cold first, warm last with the time cold leaves under --time-budget: warm's verdict
        # against safetensors has the thinnest margin (1.3-1.6x), and the first 60-95 s after the
        # install slowed every loader 2-15x in 2 of 3 main jobs of 2026-12-02. Run first, warm
        # spent its minimum rounds there and the budget ended it undecided, while cold then
        # decided in 5 rounds and left ~55 s unused; cold's verdicts held by 2-8x in such rounds.
        args.states = [s for s, wanted in (("cold", args.cold), ("warm", args.warm)) if wanted]
    args.loaders = args.loaders or default_loaders(scheme)
    if args.safetensors_backends is None:
        args.safetensors_backends = ["mmap"] if args.device == "cpu" else list(SAFETENSORS_BACKENDS)
    if args.baseline is not None:
        problem = _baseline_problem(args.baseline)
        if problem is not None:
            parser.error(f"--baseline {args.baseline}: {problem}")
    if args.source is None and args.synthetic is None:
        args.synthetic = parse_size(DEFAULT_SYNTHETIC)
    args.parser = parser
    return args


def _baseline_problem(python: str) -> str | None:
    """Why ``python`` cannot run the baseline's child (None: it can)."""
    try:
        proc = subprocess.run(
            [python, "-c", runner.CWD_OFF_PATH + "import streamer_bench.child"],
            capture_output=True,
            text=True,
            env=runner.child_env({}, own_package=False),
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run it ({exc})"
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return f"it has no streamer_bench installed ({tail[0]})"
    return None

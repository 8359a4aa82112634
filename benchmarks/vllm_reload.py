"""vLLM's in-place weight reload (``reload_weights``, what RL loops call after every training
step) per load format, on the same checkpoint, paired by round.

    python benchmarks/vllm_reload.py --model DIR [--python VLLM_PYTHON] [--rounds 5] [--reloads 3]

Each round starts one engine per load format (``safetensors``, vLLM's default; ``runai_streamer``;
``streamer``), in a rotating order, in a fresh process of the Python that has vLLM
(``streamer_bench.vllm_child``); each engine reloads the same weights ``--reloads`` times (warm:
the files were just read, as a trainer's freshly written checkpoint is) and its median reload
counts for the round. Reported: each format's median over rounds and, per round, its time over
streamer's with the bootstrap 95% interval (``streamer_bench.stats``): above 1, streamer's reload
is faster. The seconds are the wall time of ``collective_rpc("reload_weights")``: reading,
vLLM's per-parameter ``weight_loader`` copies and ``process_weights_after_loading``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from streamer_bench import stats, vllm_bench

FORMATS = ("safetensors", "runai_streamer", "streamer")
KV_CACHE_BYTES = 64 << 20


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", required=True, type=Path, help="config, tokenizer, safetensors")
    parser.add_argument("--python", default=sys.executable, help="the Python that has vLLM")
    parser.add_argument("--rounds", type=int, default=5, help="engines per format, interleaved (default 5)")
    parser.add_argument("--reloads", type=int, default=3, help="reloads per engine (default 3)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine (default 900)")
    parser.add_argument(
        "--streamer-config", type=json.loads, default={}, metavar="JSON", help="streamer's extra config"
    )
    args = parser.parse_args()
    seconds: dict[str, dict[int, float]] = {name: {} for name in FORMATS}
    env = vllm_bench._child_env(in_process=False)
    with tempfile.TemporaryDirectory(prefix="vllm-reload-") as tmp:
        for round_ in range(args.rounds):
            order = FORMATS[round_ % len(FORMATS) :] + FORMATS[: round_ % len(FORMATS)]
            for load_format in order:
                request = {
                    "model": str(args.model.resolve()),
                    "load_format": load_format,
                    "max_model_len": 128,
                    "enforce_eager": True,
                    "kv_cache_bytes": KV_CACHE_BYTES,
                    "prompt": vllm_bench.PROMPT,
                    "reloads": args.reloads,
                    "model_loader_extra_config": args.streamer_config if load_format == "streamer" else {},
                }
                result, output, _ = vllm_bench.call(args.python, request, env, Path(tmp), args.timeout)
                if result is None or not result["reload_seconds"]:
                    print(f"round {round_ + 1} {load_format}: FAILED\n{output[-2000:]}", file=sys.stderr)
                    continue
                seconds[load_format][round_] = statistics.median(result["reload_seconds"])
                print(
                    f"round {round_ + 1} {load_format}: reloads "
                    + ", ".join(f"{s:.2f}" for s in result["reload_seconds"])
                    + " s",
                    file=sys.stderr,
                )
    print(f"in-place reload of {args.model} ({args.rounds} rounds, median of {args.reloads} reloads each)")
    for load_format in FORMATS:
        if not seconds[load_format]:
            print(f"  {load_format:>15}: no reload")
            continue
        median = statistics.median(seconds[load_format].values())
        line = f"  {load_format:>15}: {median:.3f} s"
        if load_format != "streamer":
            paired = stats.compare(seconds["streamer"], seconds[load_format])
            interval = f" [{paired.low:.2f}, {paired.high:.2f}]" if paired.low is not None else ""
            ratio = f"{paired.ratio:.2f}x" if paired.ratio is not None else "-"
            line += f"   ÷ streamer per round: {ratio}{interval} {paired.verdict}"
        print(line)


if __name__ == "__main__":
    main()

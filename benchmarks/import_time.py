"""What importing each loader costs a process that already imported torch (every load pays it once).

    python benchmarks/import_time.py [--repeat 30] [--baseline PYTHON]

Each round starts one fresh interpreter per loader, in shuffled order; each imports torch, then
times the loader's import with ``time.perf_counter`` (after torch, as a server that already runs
torch pays it): ``streamer``, ``safetensors.torch`` and Run:ai's ``runai_model_streamer``, and
with ``--baseline PYTHON`` the ``streamer`` that another interpreter (another install's venv)
imports. The table gives each import's median and range; the verdicts, streamer's import against
each other's paired by round (other ÷ streamer, bootstrap 95% interval, ``streamer_bench.stats``).
The VM's CPU runs in two speeds from minute to minute, so a round's imports all run within a
second or two of each other.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys

from streamer_bench import stats

IMPORTS = {
    "streamer": "streamer",
    "safetensors": "safetensors.torch",
    "runai": "runai_model_streamer",
}
# The working directory is / so that a checkout's streamer/ folder never shadows the installed one.
_TIMED = "import time, torch; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def import_seconds(module: str, python: str = sys.executable) -> float:
    """Seconds that ``import module`` takes in a fresh interpreter that imported torch."""
    done = subprocess.run(
        [python, "-c", _TIMED.format(module=module)],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(done.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=30, help="rounds, at least 5 (default 30)")
    parser.add_argument(
        "--baseline", metavar="PYTHON", help="also time the streamer that this interpreter imports"
    )
    args = parser.parse_args()
    if args.repeat < stats.MIN_ROUNDS:
        parser.error(f"--repeat: at least {stats.MIN_ROUNDS} rounds give an interval")
    imports = {name: (sys.executable, module) for name, module in IMPORTS.items()}
    if args.baseline:
        imports["baseline"] = (args.baseline, "streamer")
    for name, (python, module) in list(imports.items()):
        try:
            import_seconds(module, python)  # also a first, untimed, import: the files into the page cache
        except subprocess.CalledProcessError as failed:
            why = (failed.stderr or "").strip().splitlines() or [f"exit status {failed.returncode}"]
            print(f"  {name}: not timed, `import {module}` fails: {why[-1]}")
            del imports[name]
    if "streamer" not in imports:
        return 1
    seconds: dict[str, dict[int, float]] = {name: {} for name in imports}
    for round_ in range(args.repeat):
        order = list(imports)
        random.Random(round_).shuffle(order)
        for name in order:
            python, module = imports[name]
            seconds[name][round_] = import_seconds(module, python)
    print(f"import after torch, {args.repeat} fresh processes each, interleaved")
    for name, values in seconds.items():
        ms = sorted(1e3 * v for v in values.values())
        print(f"  {name:12s} median {statistics.median(ms):6.1f} ms  (min-max {ms[0]:.1f}-{ms[-1]:.1f})")
    for peer in imports:
        if peer != "streamer":
            paired = stats.compare(seconds["streamer"], seconds[peer])
            interval = f"[{paired.low:.2f}, {paired.high:.2f}]" if paired.low is not None else ""
            verdict = f"{paired.ratio:.2f}x {interval} over {paired.rounds} rounds: {paired.verdict}"
            print(f"  {peer} ÷ streamer: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

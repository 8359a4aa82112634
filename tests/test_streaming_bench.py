"""``benchmarks/streaming.py`` end to end at a tiny size: it generates, evicts, streams each setting
in fresh processes, and its report holds what issue 18's note needs. Timings are not judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "streaming.py"


def test_streaming_benchmark_reports_budget_rss_warnings_and_ratio(tmp_path: Path) -> None:
    out = tmp_path / "streaming.json"
    args = [
        "--dir",
        str(tmp_path / "ckpt"),
        "--size",
        "40MiB",
        "--tensor",
        "8MiB",
        "--big",
        "16MiB",
        "--shard",
        "24MiB",
        "--rounds",
        "2",
        "--settings",
        "default,48MiB",
        "--json",
        str(out),
    ]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode in (0, 1), done.stderr  # 1: a check failed, judged below
    report = json.loads(out.read_text())
    assert len(report["runs"]) == 4 and [r["round"] for r in report["runs"]] == [0, 0, 1, 1]
    default, limited = report["summary"]["settings"]["default"], report["summary"]["settings"]["48MiB"]
    assert default["memory_limit_source"].startswith("auto: ")
    assert limited["memory_limit"] == 48 << 20 and limited["memory_limit_source"] == "user"
    for setting in (default, limited):
        assert setting["wrong_samples"] == 0 and setting["warnings"] == 0
    assert limited["peak_buffer_bytes_max"] <= 48 << 20
    checks = report["summary"]["checks"]
    assert (
        checks["no_warning"] and checks["bit_exact_samples"] and checks["peak_rss_within_budget_plus_256MiB"]
    )
    assert len(report["summary"]["ratio"]["per_round"]) == 2
    for run in report["runs"]:
        assert run["bytes"] == 40 << 20 and run["tensors"] == 4 and run["cpu_seconds"] > 0
    assert "reusing" not in done.stderr
    again = subprocess.run(
        [sys.executable, str(SCRIPT), *args[:-4], "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert "reusing the checkpoint" in again.stderr, again.stderr

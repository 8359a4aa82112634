"""``streamer-bench vllm`` without vLLM: usage errors, log parsing, the table and the JSON schema.

The end-to-end run against real vLLM is in ``integrations/vllm/tests/test_bench_vllm.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from streamer_bench import vllm_bench
from streamer_bench.cli import main


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    return model


@pytest.mark.parametrize(
    "extra",
    [
        ["--load-formats", "Safe Tensors"],
        ["--load-formats", ","],
        ["--repeat", "0"],
        ["--gpu-memory-utilization", "1.5"],
        ["--kv-cache-bytes", "lots"],
        ["--streamer-config", "[1]"],
        ["--streamer-config", "{bad"],
    ],
)
def test_bad_arguments_are_usage_errors(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["vllm", "--model", str(_model(tmp_path)), *extra])
    assert caught.value.code == 2
    assert "usage: streamer-bench vllm" in capsys.readouterr().err


def test_model_must_be_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["vllm", "--model", str(tmp_path / "nope")])
    assert caught.value.code == 2
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as caught:
        main(["vllm", "--model", str(tmp_path)])
    assert caught.value.code == 2
    assert "no *.safetensors" in capsys.readouterr().err


def test_python_without_vllm_is_a_usage_error(tmp_path: Path) -> None:
    """This suite's interpreter has no vLLM: the command says so and how to get it."""
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("vllm is importable here")
    proc = subprocess.run(
        [sys.executable, "-m", "streamer_bench", "vllm", "--model", str(_model(tmp_path))],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "cannot import vllm" in proc.stderr and "pip install vllm" in proc.stderr


LOG = """
(Worker pid=1) INFO 11-23 04:23:47 [base_loader.py:82] Initializing model took 0.247581 seconds
(Worker pid=1) INFO [loader.py:101] Loading weights took 1.52 seconds (streamer: 5 B, waiting on reads 0.40 s)
(E pid=2) INFO 11-23 04:23:48 [core.py:402] init engine (profile, create kv cache, warmup model) took 0.20 s
"""
RUNAI_LOG = (
    "Loading safetensors using Runai Model Streamer:   0% Completed | 0/21 [00:00<?, ?it/s]\r"
    "Loading safetensors using Runai Model Streamer: 100% Completed | 21/21 [01:03<00:00, 4.1it/s]\n"
)


def test_parse_log() -> None:
    assert vllm_bench.parse_log(LOG) == {
        "weights_s": 1.52,
        "read_wait_s": 0.40,
        "weights_ranks": 1,
        "weights_from": "log",
        "init_model_s": pytest.approx(0.247581),
        "init_engine_s": 0.2,
    }
    runai = vllm_bench.parse_log(RUNAI_LOG)
    assert runai["weights_s"] == 63.0 and runai["weights_from"].startswith("runai progress bar")
    assert vllm_bench.parse_log("nothing") == {}
    ranks = LOG + LOG.replace("1.52 seconds", "2.05 seconds") + LOG.replace("1.52 seconds", "0.90 seconds")
    two = vllm_bench.parse_log(ranks)
    assert two["weights_s"] == 2.05 and two["weights_ranks"] == 3  # the load ends with its slowest rank


def _run(first: float, weights: float | None, repeat: int = 0) -> dict[str, Any]:
    run: dict[str, Any] = {
        "repeat": repeat,
        "valid": True,
        "error": None,
        "resident_before_bytes": 0,
        "import_s": 1.0,
        "ready_s": first - 0.1,
        "first_token_s": first,
        "token_ids": [7],
    }
    if weights is not None:
        run.update(weights_s=weights, weights_from="log")
    return run


def test_document_and_table_follow_the_schema(tmp_path: Path) -> None:
    model = _model(tmp_path)
    args = vllm_bench.build_parser().parse_args(["--model", str(model), "--repeat", "2"])
    failed = {"repeat": 1, "valid": False, "error": "boom", "resident_before_bytes": 0}
    runs = {
        "safetensors": [_run(30.0, 9.0), _run(32.0, 11.0, repeat=1)],
        "streamer": [_run(20.0, 2.0), _run(24.0, 3.0, repeat=1)],
        "runai_streamer": [failed],
    }
    skipped = [{"load_format": "x", "reason": "r", "install": "pip install x"}]
    doc = vllm_bench.document(args, ["--model", str(model)], [model / "model.safetensors"], {}, skipped, runs)
    jsonschema.validate(doc, json.loads(vllm_bench.SCHEMA_PATH.read_text()))
    by_format = {r["load_format"]: r for r in doc["results"]}
    assert by_format["safetensors"]["median_first_token_s"] == 31.0
    assert by_format["safetensors"]["ratio_vs_streamer"] == pytest.approx(31.0 / 22.0)
    assert by_format["streamer"]["median_weights_s"] == 2.5
    assert by_format["runai_streamer"]["status"] == "failed"
    assert doc["tokens_agree"] is True
    table = vllm_bench.render(doc)
    assert "31.00 s" in table and "1.41x" in table and "failed" in table
    assert by_format["streamer"]["paired_vs_streamer"] is None
    assert by_format["safetensors"]["paired_vs_streamer"]["first_token"]["verdict"] == "too few rounds"


def test_peers_get_paired_verdicts_per_round(tmp_path: Path) -> None:
    """Each peer's seconds over streamer's in the same round: a peer slower in every round is
    "ahead" for streamer, one that swaps with it is "not separable"; a failed round drops out."""
    model = _model(tmp_path)
    args = vllm_bench.build_parser().parse_args(["--model", str(model)])
    ours = [10.0, 20.0, 12.0, 11.0, 30.0, 10.0]
    runs = {
        "streamer": [_run(t, t / 4, repeat=r) for r, t in enumerate(ours)],
        "safetensors": [_run(t * 1.5, t / 2, repeat=r) for r, t in enumerate(ours)],
        "runai_streamer": [_run(t * (1.2 if r % 2 else 0.8), None, repeat=r) for r, t in enumerate(ours)],
    }
    runs["safetensors"][5] = {"repeat": 5, "valid": False, "error": "boom", "resident_before_bytes": 0}
    doc = vllm_bench.document(args, [], [model / "model.safetensors"], {}, [], runs)
    jsonschema.validate(doc, json.loads(vllm_bench.SCHEMA_PATH.read_text()))
    by_format = {r["load_format"]: r["paired_vs_streamer"] for r in doc["results"]}
    safetensors = by_format["safetensors"]
    assert safetensors["first_token"]["rounds"] == 5
    assert safetensors["first_token"]["ratio"] == pytest.approx(1.5)
    assert safetensors["first_token"]["verdict"] == "ahead"
    assert safetensors["weights"]["ratio"] == pytest.approx(2.0)
    assert by_format["runai_streamer"]["first_token"]["verdict"] == "not separable"
    assert by_format["runai_streamer"]["weights"]["rounds"] == 0
    table = vllm_bench.render(doc)
    assert "safetensors ÷ streamer per round: first token 1.50x [1.50, 1.50] ahead (5 rounds)" in table


def test_server_command_line_carries_the_run_settings() -> None:
    request = {
        "model": "/m",
        "load_format": "streamer",
        "max_model_len": 256,
        "enforce_eager": True,
        "gpu_memory_utilization": None,
        "kv_cache_bytes": 1 << 28,
        "model_loader_extra_config": {"concurrency": 2},
    }
    args = vllm_bench.server_args(request, 8123)
    assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(args)
    for part in ("--model /m", "--load-format streamer", "--port 8123", "--max-model-len 256"):
        assert part in text
    assert "--enforce-eager" in args
    assert "--kv-cache-memory-bytes 268435456" in text and "--gpu-memory-utilization" not in text
    assert args[args.index("--model-loader-extra-config") + 1] == '{"concurrency": 2}'

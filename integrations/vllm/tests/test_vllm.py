"""``--load-format streamer`` against real vLLM on the CPU (run in the venv of scripts/setup_vllm.sh).

Every vLLM run is a fresh process tree (vLLM keeps process-wide state), started from a scratch
directory so that the checkout's sources never shadow the installed packages. Runs with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keep the engine in one process (faster); one run uses
vLLM's default multi-process mode, where the plugin must be found through its entry point in
the engine and worker processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs the vLLM venv (scripts/setup_vllm.sh)")
pytest.importorskip("streamer_vllm", reason="needs the plugin installed (scripts/setup_vllm.sh)")

import safetensors.torch
import tiny_model

HERE = Path(__file__).resolve().parent
RUN_LLM = HERE / "run_llm.py"
RUN_TIMEOUT = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cwd")


def vllm_env(multiprocess: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    env.pop("PYTHONPATH", None)
    return env


def run_llm(
    model: Path,
    load_format: str,
    extra: dict[str, Any] | None,
    cwd: Path,
    *,
    multiprocess: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(RUN_LLM), str(model), load_format, json.dumps(extra or {})]
    return subprocess.run(
        args,
        cwd=cwd,
        env=vllm_env(multiprocess) | (env or {}),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


def result_of(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    tail = "\n".join((proc.stderr + proc.stdout).splitlines()[-40:])
    raise AssertionError(f"no result (exit {proc.returncode}):\n{tail}")


@pytest.fixture(scope="module")
def reference(model_dir: Path, scratch: Path) -> dict[str, Any]:
    """What vLLM's default safetensors loader generates."""
    return result_of(run_llm(model_dir, "safetensors", None, scratch))


def test_register_is_idempotent_and_leaves_cuda_alone() -> None:
    import streamer_vllm
    import torch
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what vLLM does in each of its processes: finds us by entry point
    streamer_vllm.register()
    streamer_vllm.register()
    loader = get_model_loader(
        LoadConfig(load_format="streamer", model_loader_extra_config={"concurrency": 3})
    )
    assert type(loader).__name__ == "StreamerModelLoader"
    assert loader.options.config.concurrency == 3
    assert not torch.cuda.is_initialized()
    with pytest.raises(ValueError, match="valid keys: concurrency, block_size, memory_limit, weights"):
        get_model_loader(LoadConfig(load_format="streamer", model_loader_extra_config={"chunk": 1}))


def test_same_tokens_as_safetensors_in_multiprocess_mode(
    model_dir: Path, scratch: Path, reference: dict[str, Any]
) -> None:
    proc = run_llm(model_dir, "streamer", None, scratch, multiprocess=True)
    result = result_of(proc)
    assert result["token_ids"] == reference["token_ids"]
    assert all(len(ids) == 12 for ids in result["token_ids"])
    log = proc.stderr + proc.stdout
    # The worker is a spawned process: it found the plugin through the entry point by itself.
    assert "with load format `streamer`" in log
    worker_lines = [line for line in log.splitlines() if "Loading weights took" in line]
    assert worker_lines and "Worker" in worker_lines[0], log[-3000:]
    assert "streamer:" in worker_lines[0] and "GB/s" in worker_lines[0]


def test_weights_elsewhere_sharded_with_every_key(
    model_dir: Path, scratch: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    """--model holds only config and tokenizer; the weights are shards + index somewhere else."""
    config_only = config_only_copy(model_dir, tmp_path)
    weights = tmp_path / "weights"
    tensors = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file_name = f"model-{i + 1:05d}-of-00002.safetensors"
        weights.mkdir(exist_ok=True)
        safetensors.torch.save_file({n: tensors[n] for n in part}, str(weights / file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    (weights / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    extra = {"weights": str(weights), "concurrency": 2, "block_size": "64KiB", "memory_limit": "256KiB"}
    result = result_of(run_llm(config_only, "streamer", extra, scratch))
    assert result["token_ids"] == reference["token_ids"]


def config_only_copy(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the model directory without its safetensors: what ``--model`` points at."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for path in model_dir.iterdir():
        if not path.name.endswith(".safetensors"):
            shutil.copy(path, config_only / path.name)
    return config_only


def test_weights_from_s3(model_dir: Path, scratch: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    """``weights: s3://…`` with the S3 store given by the standard AWS environment variables."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }
        s3 = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        s3.create_bucket(Bucket="models")
        s3.upload_file(str(model_dir / "model.safetensors"), "models", "tiny/model.safetensors")
        extra = {"weights": "s3://models/tiny/"}
        proc = run_llm(config_only_copy(model_dir, tmp_path), "streamer", extra, scratch, env=env)
        assert result_of(proc)["token_ids"] == reference["token_ids"]
        assert "from s3://models/tiny/" in proc.stderr + proc.stdout
    finally:
        server.stop()


def test_bad_extra_config_key(model_dir: Path, scratch: Path) -> None:
    proc = run_llm(model_dir, "streamer", {"concurency": 4}, scratch)
    assert proc.returncode != 0
    log = proc.stderr + proc.stdout
    assert "unknown model_loader_extra_config key(s) for load format 'streamer': concurency" in log
    assert "valid keys: concurrency, block_size, memory_limit, weights" in log


def test_missing_tensor_is_named(model_dir: Path, scratch: Path, tmp_path: Path) -> None:
    tensors = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    dropped = "model.layers.1.mlp.down_proj.weight"
    del tensors[dropped]
    partial = tmp_path / "partial.safetensors"
    safetensors.torch.save_file(tensors, str(partial))
    proc = run_llm(model_dir, "streamer", {"weights": str(partial)}, scratch)
    assert proc.returncode != 0
    log = proc.stderr + proc.stdout
    assert "1 parameter(s) were not initialized from the checkpoint: " in log, log[-3000:]
    assert dropped in log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def server(model_dir: Path, scratch: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The OpenAI-compatible server on 127.0.0.1 with --load-format streamer; its log file."""
    port = _free_port()
    log_path = tmp_path / "server.log"
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", str(model_dir), "--load-format", "streamer", "--dtype", "float32"),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4"),
        *("--gpu-memory-utilization", "0.05", "--enforce-eager", "--seed", "0"),
        *("--model-loader-extra-config", json.dumps({"concurrency": 2})),
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            args,
            cwd=scratch,
            env=vllm_env(True),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"server not ready after {RUN_TIMEOUT} s:\n{log_path.read_text()[-3000:]}"
                )
            time.sleep(1)
        yield base, log_path
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_openai_server(server: tuple[str, Path], model_dir: Path, reference: dict[str, Any]) -> None:
    base, log_path = server
    from run_llm import MAX_TOKENS, PROMPTS

    body = {
        "model": str(model_dir),
        "prompt": PROMPTS[0],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{base}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["text"] == reference["text"][0]
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert "Loading weights took" in log_path.read_text()

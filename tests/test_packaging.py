"""What the installed distribution promises: its name and version, a torch range rather than a pin,
S3 as an extra that says how to install it, and dtypes an older torch lacks named, not crashed on.

The subprocess tests take things away from a real interpreter (a module, a torch dtype) before
``import streamer``, so they check the code paths an install without them would take.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

import streamer
from streamer.format.dtypes import DTYPES, NO_TORCH_DTYPE

DIST = "streamer-weights"
PLUGIN_DIST = "streamer-weights-vllm"
BENCH_DIST = "streamer-bench"
S3_MODULES = ("botocore",)
# Every dtype safetensors 0.8 defines: each is either loadable here or refused with a reason.
SAFETENSORS_DTYPES = {
    "BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64", "C64",
    "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
}  # fmt: skip


def requirements(dist: str) -> list[Requirement]:
    return [Requirement(r) for r in metadata.requires(dist) or []]


def run_python(code: str) -> dict[str, str]:
    """Runs ``code`` in a fresh interpreter (from /, so the installed package is imported); its last
    stdout line is a JSON object."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # S3 looks for credentials
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_version_is_the_distributions() -> None:
    assert streamer.__version__ == metadata.version(DIST)


def test_torch_is_a_range_not_a_pin() -> None:
    (torch_req,) = [r for r in requirements(DIST) if r.name == "torch"]
    assert [spec.operator for spec in torch_req.specifier] == [">="], torch_req
    # The floor admits the torch CI runs the main suite on, and versions newer than any known.
    assert torch_req.specifier.contains(torch.__version__.split("+")[0])
    assert torch_req.specifier.contains("9.0")


def test_s3_dependencies_only_in_the_extra() -> None:
    reqs = requirements(DIST)
    always = {r.name for r in reqs if r.marker is None}
    s3 = {r.name for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "s3"})}
    assert "botocore" in s3
    assert not always & {"aiobotocore", "boto3", "botocore", "aiohttp"}, always


@pytest.mark.parametrize(
    ("extra", "wanted"),
    [("gcs", {"google-auth"}), ("azure", {"azure-identity", "azure-storage-blob"})],
)
def test_cloud_dependencies_only_in_their_extra(extra: str, wanted: set[str]) -> None:
    reqs = requirements(DIST)
    always = {r.name for r in reqs if r.marker is None}
    chosen = {r.name for r in reqs if r.marker is not None and r.marker.evaluate({"extra": extra})}
    assert wanted <= chosen
    assert not always & wanted, always


def test_plugin_depends_on_this_distribution() -> None:
    names = {r.name for r in requirements(PLUGIN_DIST)}
    assert DIST in names
    assert "streamer" not in names  # an unrelated project on the package index


def test_the_library_holds_no_bench() -> None:
    """The bench is its own distribution: the library installs no bench module and none of the
    bench's dependencies, in any extra a user would pick."""
    files = [str(f) for f in metadata.files(DIST) or []]
    assert files and not [f for f in files if "bench" in f or "pagecache" in f]
    names = {r.name for r in requirements(DIST) if r.marker is None or r.marker.evaluate({"extra": "s3"})}
    assert not names & {"matplotlib", "runai-model-streamer", "runai-model-streamer-s3"}, names
    assert "streamer-bench" not in {ep.name for ep in metadata.distribution(DIST).entry_points}


def test_the_bench_is_its_own_distribution() -> None:
    pytest.importorskip("streamer_bench", reason="the bench is installed by scripts/setup.sh, not here")
    names = {r.name for r in requirements(BENCH_DIST)}
    assert DIST in names and "matplotlib" in names
    scripts = {ep.name: ep.value for ep in metadata.distribution(BENCH_DIST).entry_points}
    assert scripts["streamer-bench"] == "streamer_bench.cli:main"


BLOCK_S3 = f"""
import importlib.abc, json, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {S3_MODULES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Absent())
"""


def s3_load_error(missing: tuple[str, ...], config: str) -> dict[str, str]:
    """The error of an ``s3://`` load with ``config`` (Python source) while ``missing`` cannot import."""
    code = BLOCK_S3.replace(repr(S3_MODULES), repr(missing)) + (
        "import streamer\n"
        f"config = {config}\n"
        "try:\n"
        "    streamer.load('s3://bucket/model.safetensors', config=config)\n"
        "except Exception as exc:\n"
        "    print(json.dumps({'type': type(exc).__name__, 'message': str(exc),\n"
        "                      'context': repr(exc.__context__), 'cause': repr(exc.__cause__)}))\n"
    )
    return run_python(code)


ENDPOINT = "s3=streamer.S3Config(endpoint_url='http://127.0.0.1:9')"


@pytest.mark.parametrize("missing", S3_MODULES)
def test_s3_source_without_the_extra_names_the_pip_command(missing: str) -> None:
    result = s3_load_error((missing,), f"streamer.StreamerConfig({ENDPOINT})")
    assert result["type"] == "ConfigError"
    assert "pip install 'streamer-weights[s3]'" in result["message"]
    assert repr(missing) in result["message"]
    assert (result["context"], result["cause"]) == ("None", "None")


def test_cache_without_xxhash_names_the_pip_command(tmp_path: Path) -> None:
    cache = f"streamer.CacheConfig(dir={str(tmp_path)!r})"
    result = s3_load_error(("xxhash",), f"streamer.StreamerConfig({ENDPOINT}, cache={cache})")
    assert result["type"] == "ConfigError"
    assert "pip install 'streamer-weights[s3]'" in result["message"] and "xxhash" in result["message"]
    assert (result["context"], result["cause"]) == ("None", "None")


def test_import_and_local_loads_need_no_s3_modules(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(path))
    result = run_python(
        BLOCK_S3
        + "import streamer\n"
        + f"t = streamer.load_file({str(path)!r})\n"
        + "print(json.dumps({'w': t['w'].tolist(), 's3': sorted(m for m in sys.modules if m in "
        + f"{S3_MODULES!r})}}))\n"
    )
    assert result == {"w": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "s3": []}


def test_every_safetensors_dtype_loads_or_has_a_reason() -> None:
    assert set(DTYPES) | set(NO_TORCH_DTYPE) == SAFETENSORS_DTYPES
    assert not set(DTYPES) & set(NO_TORCH_DTYPE)


def one_tensor_file(path: Path, dtype: str, shape: list[int], nbytes: int) -> None:
    entries = {
        "ok": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "x": {"dtype": dtype, "shape": shape, "data_offsets": [1, 1 + nbytes]},
    }
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(1 + nbytes))


@pytest.mark.parametrize("name", sorted(NO_TORCH_DTYPE))
def test_dtype_this_torch_lacks_is_a_header_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / "m.safetensors"
    one_tensor_file(path, name, [4], 3)
    with pytest.raises(streamer.HeaderError, match="has no torch equivalent") as caught:
        streamer.load_file(path)
    assert (caught.value.path, caught.value.tensor) == (str(path), "x")


# What an older torch looks like: the dtypes it lacks are gone before streamer is imported.
NEWER_DTYPES = {"F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2", "U16": "uint16"}


def test_torch_without_newer_dtypes(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    one_tensor_file(path, "F8_E8M0", [2], 2)
    code = (
        "import json, torch\n"
        f"for attr in {sorted(NEWER_DTYPES.values())!r}:\n"
        "    if hasattr(torch, attr):  # the oldest torch tested has no float8_e8m0fnu to take\n"
        "        delattr(torch, attr)\n"
        "import streamer\n"
        "from streamer.format.dtypes import DTYPES, NO_TORCH_DTYPE\n"
        "try:\n"
        f"    streamer.load_file({str(path)!r})\n"
        "    error = None\n"
        "except streamer.HeaderError as exc:\n"
        "    error = {'message': str(exc), 'path': exc.path, 'tensor': exc.tensor}\n"
        "print(json.dumps({'dtypes': sorted(DTYPES), 'refused': sorted(NO_TORCH_DTYPE), 'error': error}))\n"
    )
    result = run_python(code)
    assert set(result["dtypes"]) == SAFETENSORS_DTYPES - {"F6_E2M3", "F6_E3M2"} - set(NEWER_DTYPES)
    assert set(result["refused"]) == {"F6_E2M3", "F6_E3M2"} | set(NEWER_DTYPES)
    error = result["error"]
    assert isinstance(error, dict)
    assert (error["path"], error["tensor"]) == (str(path), "x")
    assert f"dtype F8_E8M0 has no torch equivalent in torch {torch.__version__}" in error["message"]
    assert "torch.float8_e8m0fnu is newer: upgrade torch" in error["message"]

"""streamer-bench with an S3 source, against a real S3 server on 127.0.0.1 (moto).

One CLI run over a small generated checkpoint (module fixture, every timed load a fresh process)
is checked every way: table, JSON schema, state "remote", byte totals from S3, skipped loaders,
no secret in any output. Resolution and argument rules are checked in-process, where they are
cheap. The endpoint and credentials reach every process through the standard AWS variables.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import bench, bench_report, s3_client

from streamer_bench import report, synthetic
from streamer_bench.files import SourceProblem, SourceUnreachable, resolve

pytest.importorskip("boto3")

BUCKET = "bench"
ACCESS_KEY = "AKIDBENCHSENTINEL"
SECRET_KEY = "bench/SECRET+sentinel/0123456789"


def aws_variables(endpoint: str) -> dict[str, str]:
    """What a user exports to point every loader at an S3-compatible endpoint."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@pytest.fixture(scope="module")
def checkpoint(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> synthetic.Synthetic:
    """A 4 MiB Llama-like checkpoint in two shards with its index under s3://bench/model/, one
    shard alone under s3://bench/one/, and a prefix with no safetensors object."""
    made = synthetic.generate(tmp_path_factory.mktemp("s3bench"), 4 << 20, 2)
    s3 = s3_client(s3_server, ACCESS_KEY, SECRET_KEY)
    s3.create_bucket(Bucket=BUCKET)
    for path in [*made.files, made.index]:
        s3.upload_file(str(path), BUCKET, f"model/{path.name}")
    s3.upload_file(str(made.files[0]), BUCKET, f"one/{made.files[0].name}")
    s3.put_object(Bucket=BUCKET, Key="empty/README.md", Body=b"no weights here")
    return made


@pytest.fixture
def aws_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process resolves sources the way the CLI would: from the standard variables."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in aws_variables(s3_server).items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def run(s3_server: str, checkpoint: synthetic.Synthetic, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return bench_report(
        tmp_path_factory.mktemp("s3run"),
        "--source",
        f"s3://{BUCKET}/model/",
        "--loaders",
        "streamer,safetensors,runai,boto3,fastsafetensors,tensorizer",
        "--repeat",
        "1",
        "--safetensors-backends",
        "mmap",
        env=aws_variables(s3_server),
    )


# --- resolution -------------------------------------------------------------------------------


@pytest.mark.usefixtures("aws_env")
@pytest.mark.parametrize(
    "source",
    ["s3://bench/model/", "s3://bench/model", "s3://bench/model/model.safetensors.index.json"],
)
def test_prefix_and_index_resolve_to_every_shard(checkpoint: synthetic.Synthetic, source: str) -> None:
    resolved = resolve(source)
    assert resolved.remote and resolved.source == source and resolved.files == []
    assert resolved.shards == {f"s3://{BUCKET}/model/{f.name}": f.stat().st_size for f in checkpoint.files}
    assert resolved.tensor_bytes == checkpoint.tensor_bytes
    assert resolved.tensor_count == len(json.loads(checkpoint.index.read_text())["weight_map"])


@pytest.mark.usefixtures("aws_env")
def test_one_object_resolves_to_itself(checkpoint: synthetic.Synthetic) -> None:
    shard = checkpoint.files[0]
    resolved = resolve(f"s3://{BUCKET}/one/{shard.name}")
    assert resolved.shards == {f"s3://{BUCKET}/one/{shard.name}": shard.stat().st_size}
    assert 0 < resolved.tensor_bytes < shard.stat().st_size


@pytest.mark.usefixtures("aws_env", "checkpoint")
@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("s3://no-such-bucket/model/", "NoSuchBucket"),
        (f"s3://{BUCKET}/model/missing.safetensors", "404"),
        (f"s3://{BUCKET}/empty/", "no *.safetensors object"),
        ("ftp://bucket/model/", "gs://bucket/key"),
    ],
)
def test_missing_or_empty_sources_are_source_problems(source: str, says: str) -> None:
    with pytest.raises(SourceProblem) as exc:
        resolve(source)
    assert says in str(exc.value)
    assert SECRET_KEY not in str(exc.value)


@pytest.mark.usefixtures("aws_env")
def test_an_unreachable_endpoint_is_not_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("STREAMER_S3_MAX_ATTEMPTS", "1")
    with pytest.raises(SourceUnreachable):
        resolve(f"s3://{BUCKET}/model/")


# --- the command line -------------------------------------------------------------------------


def test_table_is_printed_in_the_remote_state(run: dict[str, Any], s3_server: str) -> None:
    stdout = run["proc"].stdout
    assert f"source: s3://{BUCKET}/model/ (S3 endpoint {s3_server.removeprefix('http://')})" in stdout
    assert "== remote:" in stdout and "cold cache" not in stdout and "warm cache" not in stdout
    for loader in ("streamer", "safetensors", "boto3"):
        assert any(line.startswith(loader) for line in stdout.splitlines()), loader
    assert "s3_ranged_get (remote):" in stdout and "memcpy" in stdout
    assert "[remote 1/" in run["proc"].stderr  # progress goes to stderr


def test_json_validates_with_state_remote_and_s3_byte_totals(
    run: dict[str, Any], checkpoint: synthetic.Synthetic, s3_server: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    doc = run["json"]
    jsonschema.validate(doc, json.loads(report.SCHEMA_PATH.read_text()), cls=jsonschema.Draft202012Validator)
    assert doc["machine"]["s3"]["endpoint_host"] == s3_server.removeprefix("http://")
    assert doc["machine"]["filesystem"]["type"] is None
    assert doc["options"]["cold"] is False and doc["options"]["warm"] is False
    files = {f["path"]: f["bytes"] for f in doc["checkpoint"]["files"]}
    assert files == {f"s3://{BUCKET}/model/{f.name}": f.stat().st_size for f in checkpoint.files}
    assert doc["checkpoint"]["tensor_bytes"] == checkpoint.tensor_bytes
    (section,) = doc["sections"]
    assert section["cache"] == "remote"
    assert section["reference"] == {"loader": "streamer", "setting": "default"}
    by_loader = {r["loader"]: r for r in section["results"]}
    for result in section["results"]:
        assert result["status"] == "ok", result
        run_ = result["runs"][0]
        assert run_["resident_before_bytes"] is None and run_["resident_at_start_bytes"] is None
    for loader in ("streamer", "safetensors", "runai"):
        if loader in by_loader:
            assert by_loader[loader]["bytes"] == checkpoint.tensor_bytes, loader
    assert by_loader["boto3"]["bytes"] == sum(files.values())  # whole objects, headers included
    ceilings = {c["name"]: c for c in section["ceilings"]}
    assert ceilings["s3_ranged_get"]["gbps"] == pytest.approx(by_loader["boto3"]["gbps"])
    assert "64 connections" in ceilings["s3_ranged_get"]["detail"]
    local = ceilings["read_buffered"]
    assert local["gbps"] is None and "not applicable" in local["error"]
    assert (run["out"] / "result.png").read_bytes()[:4] == b"\x89PNG"


def test_runai_reads_s3_when_installed(run: dict[str, Any], checkpoint: synthetic.Synthetic) -> None:
    skipped = {s["loader"]: s for s in run["json"]["skipped"]}
    if "runai" in skipped:
        pytest.skip(f"runai not run here: {skipped['runai']['reason']}")
    (result,) = [r for r in run["json"]["sections"][0]["results"] if r["loader"] == "runai"]
    assert result["status"] == "ok" and result["bytes"] == checkpoint.tensor_bytes


def test_a_baseline_install_is_timed_from_s3_beside_streamer(
    s3_server: str, checkpoint: synthetic.Synthetic, tmp_path: Path
) -> None:
    """``--baseline`` on an S3 source (``s3_load.py --baseline``): its runs are streamer's, so it
    is no store reference; the remote ceilings once failed on it with a KeyError."""
    args = ("--source", f"s3://{BUCKET}/model/", "--loaders", "streamer", "--repeat", "1")
    report = bench_report(tmp_path, *args, "--baseline", sys.executable, env=aws_variables(s3_server))
    results = {r["loader"]: r for r in report["json"]["sections"][0]["results"]}
    assert results["baseline"]["status"] == results["streamer"]["status"] == "ok"
    assert results["baseline"]["bytes"] == checkpoint.tensor_bytes


def test_local_only_loaders_are_skipped(run: dict[str, Any]) -> None:
    skipped = {s["loader"]: s for s in run["json"]["skipped"]}
    for loader in ("fastsafetensors", "tensorizer"):
        assert skipped[loader]["reason"] == "local files only"
        assert f"skipped {loader}: local files only" in run["proc"].stdout


def test_no_secret_in_any_output(run: dict[str, Any]) -> None:
    text = run["proc"].stdout + run["proc"].stderr + (run["out"] / "result.json").read_text()
    assert SECRET_KEY not in text and ACCESS_KEY not in text


def test_a_peer_without_its_s3_package_is_skipped_with_the_pip_command(
    s3_server: str, checkpoint: synthetic.Synthetic
) -> None:
    proc = bench(
        "--source",
        f"s3://{BUCKET}/model/model.safetensors.index.json",
        "--loaders",
        "runai",
        "--no-ceilings",
        env=aws_variables(s3_server) | {"STREAMER_BENCH_HIDE": "runai_model_streamer_s3"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "skipped runai: not installed" in proc.stdout:
        pytest.skip("runai-model-streamer is not installed here")
    assert (
        "skipped runai: s3:// support not installed (runai_model_streamer_s3 does not import)" in proc.stdout
    )
    assert "pip install runai-model-streamer-s3" in proc.stdout


@pytest.mark.usefixtures("checkpoint")
def test_a_missing_bucket_is_a_usage_error(s3_server: str) -> None:
    proc = bench("--source", "s3://no-such-bucket/model/", env=aws_variables(s3_server), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("streamer-bench: error:") and "no-such-bucket" in last and "NoSuchBucket" in last


def test_cache_states_do_not_apply_to_s3() -> None:
    """``--warm`` likewise (test_bench checks both flags in-process)."""
    proc = bench("--source", f"s3://{BUCKET}/model/", "--cold", timeout=120)
    assert proc.returncode == 2
    assert "--cold does not apply to a remote source" in proc.stderr and "remote" in proc.stderr


def test_a_synthetic_checkpoint_is_uploaded_and_benchmarked_from_s3(
    s3_server: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``--synthetic --upload`` (what benchmarks/s3_load.py runs per endpoint): generated, put under
    the prefix through the environment's endpoint, resolved and read back from there."""
    out = tmp_path_factory.mktemp("upload")
    args = ["--synthetic", "2MiB", "--upload", f"s3://{BUCKET}/uploaded/", "--loaders", "streamer"]
    first = bench_report(out, *args, "--repeat", "1", "--no-ceilings", env=aws_variables(s3_server))
    doc = first["json"]
    files = {f["path"]: f["bytes"] for f in doc["checkpoint"]["files"]}
    assert files and all(path.startswith(f"s3://{BUCKET}/uploaded/") for path in files)
    (section,) = doc["sections"]
    assert section["cache"] == "remote" and section["results"][0]["status"] == "ok"
    listed = s3_client(s3_server, ACCESS_KEY, SECRET_KEY).list_objects_v2(Bucket=BUCKET, Prefix="uploaded/")
    names = {item["Key"] for item in listed["Contents"]}
    assert names == {f"uploaded/{path.rsplit('/', 1)[1]}" for path in files} | {
        "uploaded/model.safetensors.index.json"
    }


@pytest.mark.parametrize(
    "args",
    [
        ["--synthetic", "1MiB", "--upload", "/tmp/x"],
        ["--source", "/tmp", "--upload", "s3://bench/x/"],
        ["--synthetic", "1MiB", "--upload", "s3://bench/x/", "--cold"],
    ],
)
def test_upload_arguments_are_checked(args: list[str]) -> None:
    proc = bench(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr


# --- benchmarks/s3_cache.py ------------------------------------------------------------------

S3_CACHE = Path(__file__).resolve().parent.parent / "benchmarks" / "s3_cache.py"


def run_cache_benchmark(s3_server: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(S3_CACHE), *args],
        env={**os.environ, **aws_variables(s3_server), "STREAMER_S3_ADDRESSING_STYLE": "path"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_the_cache_benchmark_runs_the_settings_asked_for(
    s3_server: str, checkpoint: synthetic.Synthetic, tmp_path: Path
) -> None:
    """``benchmarks/s3_cache.py`` end to end at 4 MiB with two of its settings: the cache filled
    first, then rounds of those two only, every hit read all from the cache, and their ratios.
    Timings are not judged."""
    out = tmp_path / "cache.json"
    done = run_cache_benchmark(
        s3_server,
        *("--local", str(checkpoint.files[0].parent), "--source", f"s3://{BUCKET}/model/"),
        *("--repeat", "3", "--settle", "0", "--settings", "hit cold, local cold"),
        *("--work", str(tmp_path / "work"), "--json", str(out)),
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(out.read_text())
    runs = found["runs"]
    assert len(runs) == 6 and {r["setting"] for r in runs} == {"hit cold", "local cold"}
    assert [r["setting"] for r in runs[:2]] == ["local cold", "hit cold"]  # round 0 in table order
    for hit in (r["metrics"] for r in runs if r["setting"] == "hit cold"):
        assert hit["cache_miss_bytes"] == 0 and hit["cache_hit_bytes"] == hit["bytes"] > 0
    assert [(v["compared"], v["clock"]) for v in found["ratios"]] == [
        ("local cold / hit cold", "load"),
        ("local cold / hit cold", "run"),
    ]
    assert all(v["ratio"] > 0 for v in found["ratios"])
    assert found["interrupted"] is None
    assert SECRET_KEY not in done.stdout + done.stderr


def test_the_cache_benchmark_cut_by_sigterm_reports_its_finished_runs(
    s3_server: str, checkpoint: synthetic.Synthetic, tmp_path: Path
) -> None:
    """As ``timeout`` cuts it: the runs so far are summed up and written, the work directory is
    removed, and the exit status is SIGTERM's."""
    out, work = tmp_path / "cache.json", tmp_path / "work"
    proc = subprocess.Popen(
        [
            *(sys.executable, str(S3_CACHE), "--local", str(checkpoint.files[0].parent)),
            *("--source", f"s3://{BUCKET}/model/", "--repeat", "100", "--settle", "0"),
            *("--settings", "hit cold,local cold", "--work", str(work), "--json", str(out)),
        ],
        env={**os.environ, **aws_variables(s3_server), "STREAMER_S3_ADDRESSING_STYLE": "path"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith("round 1 "):
                break
        else:
            pytest.fail("the benchmark ended before its second round")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM: stopped" in stdout and "median seconds: " in stdout
    found = json.loads(out.read_text())
    assert found["interrupted"] == "SIGTERM" and 3 <= len(found["runs"]) < 200
    assert not work.exists()


def test_the_cache_benchmark_refuses_an_unknown_setting(s3_server: str, tmp_path: Path) -> None:
    done = run_cache_benchmark(
        s3_server, "--local", str(tmp_path), "--source", "s3://b/p/", "--settings", "hit cold,warm"
    )
    assert done.returncode == 2 and "settings are some of local cold, hit cold" in done.stderr

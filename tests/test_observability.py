"""One event per load, and Prometheus metrics when asked for (``streamer.observe``): what each API
reports, errors by type, no secret and no path in a label, textfiles and multi-process
collection, and exporters that cannot write never failing a load."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_dict, random_tensor, write_checkpoint

import streamer
from streamer import StreamerConfig
from streamer.observe.events import LoadRecord, public_source

prometheus_client = pytest.importorskip("prometheus_client")
from streamer.metrics import REGISTRY, SERIES, DirectoryCollector  # noqa: E402  (needs the extra)

LOAD = {"scheme": "file", "device": "cpu"}
OK = {**LOAD, "result": "ok", "error": ""}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Any:
    g = torch.Generator().manual_seed(39)
    tensors = {f"layer.{i}.weight": random_tensor((64, 96), torch.float32, g) for i in range(6)}
    return write_checkpoint(tmp_path / "ckpt", tensors, shards=2)


def value(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


ON = StreamerConfig(metrics=True)


def test_every_api_counts_one_load_with_its_bytes(checkpoint: Any) -> None:
    nbytes = tensor_bytes(checkpoint.tensors)

    def counted(action: Any) -> tuple[float, float, float]:
        before = (
            value("streamer_loads_total", OK),
            value("streamer_loaded_bytes_total", LOAD),
            value("streamer_load_seconds_count", {**LOAD, "result": "ok"}),
        )
        action()
        return (
            value("streamer_loads_total", OK) - before[0],
            value("streamer_loaded_bytes_total", LOAD) - before[1],
            value("streamer_load_seconds_count", {**LOAD, "result": "ok"}) - before[2],
        )

    def iterate() -> None:
        with streamer.open(checkpoint.directory, config=ON) as handle:
            assert_same_dict(dict(handle), checkpoint.tensors)

    def get_each() -> None:  # one load however many reads the handle makes
        with streamer.safe_open(str(checkpoint.shards[0]), "pt", config=ON) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open's own keys())
                f.get_tensor(name)

    def load_into() -> None:
        dest = {name: torch.empty_like(t) for name, t in checkpoint.tensors.items()}
        streamer.load_into(dest, checkpoint.directory, config=ON)
        assert_same_dict(dest, checkpoint.tensors)

    first_shard = tensor_bytes(streamer.load_file(checkpoint.shards[0]))
    assert counted(lambda: streamer.load(checkpoint.directory, config=ON)) == (1, nbytes, 1)
    assert counted(iterate) == (1, nbytes, 1)
    assert counted(get_each) == (1, first_shard, 1)
    assert counted(load_into) == (1, nbytes, 1)
    assert counted(lambda: streamer.open(checkpoint.directory, config=ON).close()) == (
        0,
        0,
        0,
    )  # nothing read


def test_failures_count_by_error_type_and_the_event_says_which(
    checkpoint: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = {**LOAD, "result": "error", "error": "MissingFileError"}
    header = {**LOAD, "result": "error", "error": "HeaderError"}
    truncated = {**LOAD, "result": "error", "error": "ReadError"}
    before = {key: value("streamer_loads_total", labels) for key, labels in
              [("missing", missing), ("header", header), ("truncated", truncated)]}  # fmt: skip
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"<html>not found</html>" * 10)
    cut = tmp_path / "cut"
    write_checkpoint(cut, checkpoint.tensors, index=False)
    shard = next(cut.glob("*.safetensors"))
    with caplog.at_level(logging.INFO, logger="streamer"):
        with pytest.raises(streamer.MissingFileError):
            streamer.load(tmp_path / "nowhere.safetensors", config=ON)
        with pytest.raises(streamer.HeaderError):
            streamer.load(junk, config=ON)
        with streamer.open(shard, config=ON) as handle:
            os.truncate(shard, shard.stat().st_size - 1000)
            with pytest.raises(streamer.ReadError):
                list(handle)
    assert value("streamer_loads_total", missing) == before["missing"] + 1
    assert value("streamer_loads_total", header) == before["header"] + 1
    assert value("streamer_loads_total", truncated) == before["truncated"] + 1
    lines = [record.getMessage() for record in caplog.records if record.name == "streamer"]
    assert len(lines) == 3
    assert all("load FAILED" in line for line in lines)
    assert "(ReadError)" in lines[2] and str(shard) in lines[2]


def test_one_info_event_per_load_as_text_or_json(checkpoint: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="streamer"):
        streamer.load(checkpoint.directory)  # metrics off: the event is still logged
        streamer.load(checkpoint.directory, config=StreamerConfig(log_format="json"))
    text, as_json = (r.getMessage() for r in caplog.records if r.name == "streamer")
    assert text.startswith("streamer: loaded ") and "GB/s" in text and str(checkpoint.directory) in text
    event = json.loads(as_json)
    assert event["result"] == "ok" and event["scheme"] == "file" and event["device"] == "cpu"
    assert event["bytes"] == tensor_bytes(checkpoint.tensors) and event["tensors"] == len(checkpoint.tensors)
    assert event["files"] == 2 and event["seconds"] > 0 and event["time_to_first_tensor_s"] > 0
    assert caplog.records[-1].streamer_load == event  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("source", "shown", "scheme"),
    [
        ("/data/model", "/data/model", "file"),
        ("s3://bucket/llama/model.safetensors", "s3://bucket/llama/model.safetensors", "s3"),
        ("gs://bucket/m/", "gs://bucket/m/", "gs"),
        ("az://container/m", "az://container/m", "az"),
        (
            "https://acct.blob.core.windows.net/c/m.safetensors?sv=2024&sig=SECRETSIG",
            "https://acct.blob.core.windows.net/c/m.safetensors",
            "az",
        ),
        ("https://user:SECRETPW@example.com/m#frag", "https://example.com/m", "https"),
    ],
)
def test_the_event_never_shows_a_secret(source: str, shown: str, scheme: str) -> None:
    assert public_source(source) == (shown, scheme)
    record = LoadRecord(source, "cpu")
    record.fail(streamer.SourceError("denied: key=SECRETKEY", path=source))
    event = record.event()
    assert event is not None and "SECRET" not in json.dumps(event.as_dict()) + event.line()


def test_labels_are_few_and_never_a_path(checkpoint: Any) -> None:
    streamer.load(checkpoint.directory, config=ON)
    allowed = {"scheme", "device", "result", "error", "origin", "le"}
    for family in REGISTRY.collect():
        for sample in family.samples:
            assert set(sample.labels) <= allowed, sample
            for label, text in sample.labels.items():
                assert "/" not in text and str(checkpoint.directory) not in text, (label, text)
    names = {s.name for s in SERIES}
    assert {f.name for f in REGISTRY.collect()} == names


def test_the_default_is_off_and_nothing_is_imported(checkpoint: Any) -> None:
    assert StreamerConfig().metrics is False and StreamerConfig().metrics_textfile is None
    code = f"""
        import sys, streamer
        streamer.load({str(checkpoint.directory)!r})
        assert "prometheus_client" not in sys.modules, "imported"
        """
    run_python(code)


def test_the_textfile_holds_the_process_series(checkpoint: Any, tmp_path: Path) -> None:
    out = tmp_path / "metrics"
    out.mkdir()
    streamer.load(
        checkpoint.directory, config=StreamerConfig(metrics_textfile=str(out / "streamer-{pid}.prom"))
    )
    written = out / f"streamer-{os.getpid()}.prom"
    text = written.read_text()
    assert "streamer_loaded_bytes_total" in text and "python_gc" not in text and "process_" not in text
    assert list(out.iterdir()) == [written]  # written whole, then renamed: no temporary left


def test_an_unwritable_textfile_warns_once_and_the_load_goes_on(checkpoint: Any, tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory")
    config = StreamerConfig(metrics_textfile=str(blocked / "m.prom"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_same_dict(streamer.load(checkpoint.directory, config=config), checkpoint.tensors)
    messages = [str(w.message) for w in caught if "metrics textfile" in str(w.message)]
    assert len(messages) == 1 and str(blocked) in messages[0]


def test_an_unwritable_multiprocess_directory_warns_once_and_loads(checkpoint: Any, tmp_path: Path) -> None:
    code = f"""
        import warnings, streamer
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            for _ in range(3):
                got = streamer.load({str(checkpoint.directory)!r})
        assert len(got) == {len(checkpoint.tensors)}
        recorded = [w for w in caught if "not recorded" in str(w.message)]
        assert len(recorded) == 1, [str(w.message) for w in caught]
        """
    gone = tmp_path / "no" / "such" / "dir"
    run_python(code, PROMETHEUS_MULTIPROC_DIR=str(gone), STREAMER_METRICS="1")


def test_worker_processes_reach_one_exporter(checkpoint: Any, tmp_path: Path) -> None:
    """Under PROMETHEUS_MULTIPROC_DIR the exporter's MultiProcessCollector sees every process's
    loads; without it, each process's textfile and a DirectoryCollector do."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    nbytes = tensor_bytes(checkpoint.tensors)
    shared = tmp_path / "multiproc"
    shared.mkdir()
    textfiles = tmp_path / "textfiles"
    textfiles.mkdir()
    code = f"import streamer; streamer.load({str(checkpoint.directory)!r})"
    for _ in range(2):
        run_python(code, PROMETHEUS_MULTIPROC_DIR=str(shared), STREAMER_METRICS="1")
        run_python(code, STREAMER_METRICS_TEXTFILE=str(textfiles / "streamer-{pid}.prom"))
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(shared))
    assert registry.get_sample_value("streamer_loaded_bytes_total", LOAD) == 2 * nbytes
    collected = CollectorRegistry()
    collected.register(DirectoryCollector(str(textfiles)))
    assert collected.get_sample_value("streamer_loaded_bytes_total", LOAD) == 2 * nbytes
    assert collected.get_sample_value("streamer_loads_total", OK) == 2
    assert collected.get_sample_value("streamer_load_seconds_count", {**LOAD, "result": "ok"}) == 2


def test_serve_exports_over_http(checkpoint: Any) -> None:
    code = f"""
        import socket, urllib.request, streamer, streamer.metrics
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        streamer.metrics.serve(port, "127.0.0.1")
        streamer.load({str(checkpoint.directory)!r}, config=streamer.StreamerConfig(metrics=True))
        with urllib.request.urlopen(f"http://127.0.0.1:{{port}}/metrics", timeout=10) as response:
            print(response.read().decode())
        """
    scraped = run_python(code)
    nbytes = tensor_bytes(checkpoint.tensors)
    assert f'streamer_loaded_bytes_total{{device="cpu",scheme="file"}} {float(nbytes)}' in scraped
    assert "process_cpu_seconds_total" in scraped  # the process's own series, as an exporter shows


def test_the_collectors_show_in_the_default_registry(checkpoint: Any) -> None:
    streamer.load(checkpoint.directory, config=ON)
    assert (prometheus_client.REGISTRY.get_sample_value("streamer_loaded_bytes_total", LOAD) or 0) > 0


def run_python(code: str, **env: str) -> str:
    """Runs ``code`` in a fresh interpreter with ``env`` added, outside the checkout (so that it
    imports the installed package); its stdout (a failure shows stderr)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMER_", "PROMETHEUS_"))}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment | env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "streamer-loads.json"


def exposed() -> dict[str, set[str]]:
    """Every sample name the collectors expose, with the labels it carries."""
    names: dict[str, set[str]] = {}
    for series in SERIES:
        if series.buckets is None:
            names[f"{series.name}_total"] = set(series.labels)
        else:
            names[f"{series.name}_bucket"] = {*series.labels, "le"}
            names[f"{series.name}_sum"] = names[f"{series.name}_count"] = set(series.labels)
    return names


def test_every_dashboard_query_names_a_series_the_exporter_emits() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exposed()
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(queries) >= 10
    for query in queries:
        used = re.findall(r"\b(streamer_[a-z0-9_]+)(\{[^}]*\})?", query)
        assert used, query
        for name, matchers in used:
            assert name in names, f"{name} is not exported: {query}"
            labels = set(re.findall(r"(\w+)\s*=~?", matchers))
            assert labels <= names[name], f"{name} has no label {labels - names[name]}: {query}"
        for grouped in re.findall(r"by \(([^)]*)\)", query):
            wanted = {label.strip() for label in grouped.split(",")} - {"$by"}
            assert all(wanted <= names[name] for name, _ in used), query
    # Importable as it is: every panel on the grid, ids unique, the datasource a variable.
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "by"} <= variables
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert panel["datasource"]["uid"] == "${datasource}" and grid["x"] + grid["w"] <= 24
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("cold-start seconds", "gb/s", "hit ratio", "retries", "throttling", "error"):
        assert topic in titles, topic


def test_a_record_sums_every_read_of_a_load_and_the_collectors_split_bytes_by_origin() -> None:
    """Two reads of one handle (a group rank's, through the node cache) make one event: sums,
    the first tensor from the open, and every origin of the bytes."""
    record = LoadRecord("s3://models/llama/?X-Amz-Signature=SECRET", "cpu")
    base = {"files": 2, "tensors": 3, "bytes": 600, "bytes_read": 400, "requests": 5, "retries": 2,
            "throttles": 1, "cache_hit_bytes": 100, "cache_miss_bytes": 250, "cache_write_bytes": 250,
            "cache_errors": 1, "cache_dropped": 0, "cache_evictions": 3, "consumer_wait_s": 0.5,
            "memory_wait_s": 0.2, "time_to_first_tensor_s": 0.1,
            "group": {"received_bytes": 200}}  # fmt: skip
    record.add(base)
    record.add({**base, "time_to_first_tensor_s": 0.05})
    event = record.event()
    assert event is not None and record.event() is None  # reported once
    assert (event.source, event.scheme) == ("s3://models/llama/", "s3")
    assert (event.bytes, event.bytes_read, event.tensors, event.files) == (1200, 800, 6, 2)
    assert (event.requests, event.retries, event.throttles, event.cache_evictions) == (10, 4, 2, 6)
    assert event.group_received_bytes == 400 and event.cache_checksum_failures == 2
    assert event.storage_wait_s == pytest.approx(0.6) and event.consumer_stall_s == pytest.approx(0.4)
    s3 = {"scheme": "s3", "device": "cpu"}
    before = {o: value("streamer_read_bytes_total", {**s3, "origin": o}) for o in
              ("storage", "cache_hit", "cache_miss", "group")}  # fmt: skip
    throttled = value("streamer_throttles_total", {"scheme": "s3"})
    from streamer.observe import prometheus

    prometheus.record(event)
    grown = {o: value("streamer_read_bytes_total", {**s3, "origin": o}) - before[o] for o in before}
    assert grown == {"storage": 100, "cache_hit": 200, "cache_miss": 500, "group": 400}
    assert value("streamer_throttles_total", {"scheme": "s3"}) - throttled == 2

"""streamer-bench end to end: one small generated checkpoint, one real CLI run, checked every way.

The expensive part (a run of the CLI: every timed load is a fresh Python process importing
torch) happens once, in a module fixture; the tests read its stdout, JSON and PNG. Argument
errors and the refusal logic are checked in-process, where they are cheap.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import mmap
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import BENCH_ENV, bench, bench_report

from streamer.host.machine import free_page_reporting
from streamer_bench import arguments, ceilings, cli, pagecache, report, runner, synthetic
from streamer_bench.files import CheckpointFiles, resolve
from streamer_bench.loaders import INTO_SETTING, Setting

MiB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    return bench_report(
        out,
        "--synthetic",
        "4MiB",
        "--shards",
        "2",
        "--keep",
        str(out / "keep"),
        "--loaders",
        "streamer,safetensors,runai,fastsafetensors,instanttensor",
        "--cold",
        "--warm",
        "--repeat",
        "1",
        "--runai-strategies",
        "default",
        "--safetensors-backends",
        "mmap",
        env={"STREAMER_BENCH_HIDE": "fastsafetensors"},  # a peer that is "not installed", for sure
    )


def test_table_is_printed(run: dict[str, Any]) -> None:
    stdout = run["proc"].stdout
    assert "== cold cache" in stdout and "== warm cache" in stdout
    columns = ("loader", "setting", "median s", "min-max s", "GB/s", "vs streamer", "peak RSS")
    for column in (*columns, "faults/GiB", "CPU s"):
        assert column in stdout
    for loader in ("streamer", "safetensors", "runai"):
        assert any(line.startswith(loader) for line in stdout.splitlines())
    assert "storage ceilings" in stdout and "memcpy" in stdout and "first_touch" in stdout
    assert "[cold 1/4]" in run["proc"].stderr  # progress goes to stderr (streamer's into=touched row too)
    assert any(line.startswith("streamer") and "into=touched" in line for line in stdout.splitlines())
    assert "÷ ceiling" in stdout and "-- cold: bound by " in stdout and "-- cold: stopped: " in stdout
    assert "-- cold: streamer ÷ read ceiling, paired by round" in stdout  # its ceiling measured in its round


def test_json_validates_against_the_schema(run: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(report.SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(run["json"], schema, cls=jsonschema.Draft202012Validator)
    doc = run["json"]
    machine = doc["machine"]
    assert machine["cpu_count"] >= 1 and machine["ram_bytes"] > 0 and machine["kernel"]
    assert machine["filesystem"]["type"] and machine["versions"]["torch"] and machine["versions"]["streamer"]
    assert doc["checkpoint"]["tensor_bytes"] > 3 * MiB and len(doc["checkpoint"]["files"]) == 2
    for section in doc["sections"]:
        assert section["reference"] == {"loader": "streamer", "setting": "default"}
        by_loader = {r["loader"]: r for r in section["results"] if r["setting"] != "into=touched"}
        assert set(by_loader) == {"streamer", "safetensors", "runai"}
        assert section["stopped"].startswith("1 rounds, the most asked for")
        for result in section["results"]:
            assert result["status"] == "ok", result
            assert result["bytes"] == doc["checkpoint"]["tensor_bytes"]
            assert result["peak_rss_bytes"] > 0 and result["gbps"] > 0
        assert by_loader["streamer"]["ratio_vs_streamer"] == pytest.approx(1.0)
        for result in section["results"]:  # the row's time over streamer's, as the verdicts read
            expected = by_loader["streamer"]["gbps"] / result["gbps"]
            assert result["ratio_vs_streamer"] == pytest.approx(expected)
        # Each child's own high-water mark, not the bench's inherited one: loaders differ.
        assert len({result["peak_rss_bytes"] for result in section["results"]}) > 1
        for run in (r for result in section["results"] for r in result["runs"]):
            assert run["minor_faults"] > 0 and run["cpu_seconds"] > 0  # loading fresh memory faults
            assert run["seconds"] == run["load_seconds"]  # the default clock
            assert run["process_seconds"] > run["load_seconds"]  # interpreter and imports on top
            assert run["machine_busy_cores"] >= 0 and run["machine_stolen_cores"] >= 0
        compared = {c["loader"]: c for c in section["comparisons"]}
        assert set(compared) == {"safetensors", "runai"}
        assert all(c["verdict"] == "too few rounds" and c["rounds"] == 1 for c in compared.values())
        assert by_loader["streamer"]["runs"][0]["metrics"]["bytes"] == doc["checkpoint"]["tensor_bytes"]
        assert {c["name"] for c in section["ceilings"]} >= {"read_buffered"}
    memory = {c["name"] for c in doc["memory_ceilings"]}
    assert memory >= {"memcpy", "first_touch", "first_touch_hugepage", "page_fill"}


def test_plot_is_a_png(run: dict[str, Any]) -> None:
    path = run["out"] / "result.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000


def test_the_prometheus_textfile_holds_every_result(run: dict[str, Any]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families((run["out"] / "result.prom").read_text())
        for sample in family.samples
    }
    for section in run["json"]["sections"]:
        for result in section["results"]:
            cache, loader, setting = section["cache"], result["loader"], result["setting"]
            labels = (("cache", cache), ("loader", loader), ("setting", setting))
            assert samples[("streamer_bench_seconds", labels)] == pytest.approx(result["median_s"])
            assert samples[("streamer_bench_gbps", labels)] == pytest.approx(result["gbps"])
        for ceiling in section["ceilings"]:
            key = ("streamer_bench_ceiling_gbps", (("cache", section["cache"]), ("name", ceiling["name"])))
            assert samples[key] == pytest.approx(ceiling["gbps"])
    assert samples[("streamer_bench_timestamp_seconds", ())] > 1.7e9


def test_missing_peer_is_skipped(run: dict[str, Any]) -> None:
    skipped = {s["loader"]: s for s in run["json"]["skipped"]}
    assert "not installed" in skipped["fastsafetensors"]["reason"]
    assert skipped["fastsafetensors"]["install"] == "pip install fastsafetensors"
    # instanttensor is CUDA only: skipped on the CPU whether it is installed or not.
    assert "CUDA only" in skipped["instanttensor"]["reason"]
    assert "skipped fastsafetensors: not installed" in run["proc"].stdout
    assert "pip install fastsafetensors" in run["proc"].stdout


def test_cold_runs_started_from_an_empty_page_cache(run: dict[str, Any]) -> None:
    doc = run["json"]
    file_bytes = sum(f["bytes"] for f in doc["checkpoint"]["files"])
    cold, warm = doc["sections"]
    assert cold["cache"] == "cold" and warm["cache"] == "warm"
    for result in cold["results"]:
        for r in result["runs"]:
            assert r["valid"] and r["resident_before_bytes"] == 0 and r["resident_at_start_bytes"] == 0
    for result in warm["results"]:
        for r in result["runs"]:
            assert r["valid"] and r["resident_before_bytes"] == file_bytes == r["resident_at_start_bytes"]


def test_eviction_is_real(run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Cross-checks make_cold with util-linux fincore (independent of streamer's mincore)."""
    if "STREAMER_NATIVE_LIB" in BENCH_ENV:  # a developer build of the engine (conftest strips STREAMER_*)
        monkeypatch.setenv("STREAMER_NATIVE_LIB", BENCH_ENV["STREAMER_NATIVE_LIB"])
    files = [Path(f["path"]) for f in run["json"]["checkpoint"]["files"]]
    assert pagecache.make_warm(files) == 0
    assert pagecache.resident_total(files) > 0  # (a VM balloon may take a page back at any time)
    assert pagecache.make_cold(files) == 0
    if shutil.which("fincore"):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert [int(x) for x in out] == [0] * len(files)


def test_a_cold_figure_is_refused_when_eviction_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    monkeypatch.setattr(pagecache, "make_cold", lambda files: 4096)
    monkeypatch.setattr(runner, "call_child", lambda *a, **k: pytest.fail("a child ran"))
    config = runner.Config(Setting("streamer"), [str(f) for f in made.files], str(made.index))
    runner.run_section(
        [config], "cold", 2, device="cpu", streamer_api="open", timeout=60, progress=lambda _: None
    )
    summary = report.summarize(config)
    assert summary["status"] == "refused" and summary["median_s"] is None and summary["gbps"] is None
    assert all(not r.valid and r.error and "not cold" in r.error for r in config.runs)


def test_rounds_after_the_first_are_shuffled_so_neighbours_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    files = [str(f) for f in made.files]
    index = str(made.index)
    configs = [runner.Config(Setting("streamer", (("concurrency", c),)), files, index) for c in range(1, 7)]
    order: list[int] = []
    monkeypatch.setattr(runner, "_prepare", lambda config, state: (0, None))

    def child(
        request: dict[str, Any], env: dict[str, str], timeout: float, python: str | None
    ) -> dict[str, Any]:
        order.append(request["knobs"]["concurrency"])
        return {"ok": False, "error": "not run"}

    monkeypatch.setattr(runner, "call_child", child)
    runner.run_section(
        configs, "warm", 4, device="cpu", streamer_api="open", timeout=60, progress=lambda _: None
    )
    rounds = [order[i : i + 6] for i in range(0, len(order), 6)]
    assert rounds[0] == [1, 2, 3, 4, 5, 6]  # the first round in table order
    assert all(sorted(r) == [1, 2, 3, 4, 5, 6] for r in rounds)  # every setting once per round
    predecessors = {c: {r[r.index(c) - 1] for r in rounds if r.index(c) > 0} for c in range(2, 7)}
    assert any(len(p) > 1 for p in predecessors.values())
    assert rounds == [[c.setting.knobs[0][1] for c in runner.round_order(configs, i)] for i in range(4)]


@pytest.mark.parametrize("clock", ["load", "process"])
def test_each_run_starts_settle_seconds_after_its_files_were_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: str
) -> None:
    """On a VM with free page reporting, a run right after another would find that run's freed
    memory still backed by the host, and the next a moment later would not: each waits instead.
    With the load clock the child starts at once (its imports are not timed) and is told when the
    settle ends; with the process clock the settle passes before it starts."""
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    config = runner.Config(Setting("streamer"), [str(f) for f in made.files], str(made.index))
    prepared: list[float] = []
    started: list[tuple[float, float]] = []  # (when the child started, its settle_until)

    def prepare(config: runner.Config, state: str) -> tuple[int, None]:
        prepared.append(time.monotonic())
        return 0, None

    def child(request: dict[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        started.append((time.monotonic(), request["settle_until"]))
        return {"ok": False, "error": "not run"}

    monkeypatch.setattr(runner, "_prepare", prepare)
    monkeypatch.setattr(runner, "call_child", child)
    runner.run_section(
        [config],
        "warm",
        3,
        device="cpu",
        streamer_api="open",
        timeout=60,
        progress=lambda _: None,
        clock=clock,
        settle=1.0,
    )
    assert len(started) == 3
    for p, (s, until) in zip(prepared, started, strict=True):
        assert until - p >= 1.0
        assert (s - p >= 1.0) if clock == "process" else (s < until)


def test_the_child_starts_its_clock_only_after_the_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from streamer_bench import child

    def prepare(request: dict[str, Any]) -> Any:
        return lambda: child.Loaded({"w": torch.ones(2)})

    monkeypatch.setitem(child.PREPARERS, "streamer", prepare)
    until = time.monotonic() + 0.3
    result = child.time_load(
        {"loader": "streamer", "device": "cpu", "files": [], "cache": None, "settle_until": until}
    )
    assert time.monotonic() >= until and result["seconds"] < 0.3
    assert result["process_seconds"] < child._since_process_start() - 0.25  # the wait is not counted


def test_settle_defaults_to_the_vm_s_free_page_reporting(run: dict[str, Any]) -> None:
    expected = runner.DEFAULT_SETTLE if free_page_reporting() else 0.0
    assert run["json"]["options"]["settle_seconds"] == expected
    assert run["json"]["machine"]["free_page_reporting"] is free_page_reporting()
    said = f"started {expected:g} s after its files were ready"
    assert (said in run["proc"].stdout) is (expected > 0)


@pytest.mark.parametrize(
    "args",
    [
        ["--repeat", "0"],
        ["--repeat", "many"],
        ["--settle", "-1"],
        ["--settle", "soon"],
        ["--time-budget", "0"],
        ["--time-budget", "soon"],
        ["--synthetic", "lots"],
        ["--loaders", "streamer,nosuchloader"],
        ["--device", "tpu"],
        ["--sweep", "threads=1,2"],
        ["--sweep", "concurrency=0"],
        ["--source", "a.safetensors", "--synthetic", "1GiB"],
        ["--source", "s3://bucket/model", "--cold"],
        ["--source", "s3://bucket/model", "--warm"],
        ["--source", "ftp://bucket/model"],
        ["--source", "model.safetensors", "--shards", "3"],
        ["--safetensors-backends", "zip"],
        ["--baseline", "/nonexistent/bin/python"],
        ["--baseline", "/bin/false"],
        ["--no-such-flag"],
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        arguments.parse_args(args)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_baseline_runs_beside_streamer_and_is_paired_like_a_peer(tmp_path: Path) -> None:
    """--baseline times another interpreter's streamer (here: this one's) in the same rounds."""
    done = bench_report(
        tmp_path,
        "--synthetic",
        "2MiB",
        "--loaders",
        "streamer",
        "--warm",
        "--repeat",
        "2",
        "--no-ceilings",
        "--baseline",
        sys.executable,
    )
    assert done["proc"].returncode == 0, done["proc"].stderr
    (section,) = done["json"]["sections"]
    loaders = {r["loader"]: r for r in section["results"]}
    assert set(loaders) == {"streamer", "baseline"}
    assert loaders["baseline"]["status"] == "ok" and loaders["baseline"]["valid_runs"] == 2
    (comparison,) = section["comparisons"]
    assert comparison["loader"] == "baseline" and comparison["rounds"] == 2
    assert done["json"]["options"]["baseline"] == sys.executable


def test_a_gpu_run_makes_the_cuda_context_before_its_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every loader's first CUDA call would otherwise time the context's creation as its load."""
    import torch

    from streamer_bench import child

    calls: list[str] = []
    monkeypatch.setattr(torch, "zeros", lambda *a, device: calls.append(f"context {device}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(f"sync {device}"))
    clock = iter([5.0, 5.0, 10.0, 20.0, 21.5, 30.0])  # settle (none asked), cache state, load
    monkeypatch.setattr(child.time, "perf_counter", lambda: next(clock))

    def prepare(request: dict[str, Any]) -> Any:
        calls.append("prepared")
        return lambda: calls.append("load") or child.Loaded({"w": torch.ones(2)})

    monkeypatch.setitem(child.PREPARERS, "streamer", prepare)
    result = child.time_load({"loader": "streamer", "device": "cuda:1", "files": [], "cache": None})
    assert calls == ["prepared", "context cuda:1", "sync cuda:1", "load", "sync cuda:1"]
    assert result["seconds"] == 30.0 - 21.5


def _processes_naming(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker`` (a run's children name its files)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile
    return found


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_cut_by_a_signal_reports_the_runs_that_finished(tmp_path: Path, signum: int) -> None:
    """Ctrl-C or ``timeout`` mid-run: the child in flight is killed, the finished runs are
    reported and written (marked interrupted), and the exit status is the signal's."""
    keep = tmp_path / "keep"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "streamer_bench", "--synthetic", "2MiB", "--keep", str(keep)),
            *(
                "--loaders",
                "streamer,safetensors",
                "--safetensors-backends",
                "mmap",
                "--warm",
                "--no-into-touched",
            ),
            *("--repeat", "100", "--min-rounds", "100", "--no-ceilings", "--settle", "0"),
            *("--json", str(tmp_path / "out.json")),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=BENCH_ENV,
        cwd=tempfile.gettempdir(),
    )
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            if "[warm 3/200]" in line:
                break
        else:
            pytest.fail("the run ended before its third load")
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr
    name = signal.Signals(signum).name
    assert f"INTERRUPTED by {name} during the warm runs" in stdout
    assert "== warm cache" in stdout and any(line.startswith("streamer") for line in stdout.splitlines())
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["interrupted"] == {"signal": name, "during": "warm runs"}
    (section,) = doc["sections"]
    runs = [r for result in section["results"] for r in result["runs"]]
    assert 3 <= len(runs) < 200 and all(r["valid"] for r in runs)  # the killed child left no run
    assert _processes_naming(str(keep)) == []
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, json.loads(report.SCHEMA_PATH.read_text()), cls=jsonschema.Draft202012Validator)


def test_a_signal_while_the_checkpoint_is_made_leaves_no_temporary_files(tmp_path: Path) -> None:
    """A generated checkpoint lives in a temporary directory: SIGTERM (``timeout``) before the first
    run must remove it, not leave gigabytes behind."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamer_bench", "--synthetic", "2GiB", "--loaders", "streamer"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=BENCH_ENV | {"TMPDIR": str(temp)},
        cwd=tempfile.gettempdir(),
    )
    try:
        deadline = time.monotonic() + 120
        while not any(f.stat().st_size > 0 for f in temp.glob("streamer-bench-*/**/*.safetensors")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint file appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM before any run" in stderr
    assert list(temp.iterdir()) == []


def test_bad_arguments_exit_2_from_the_command_line() -> None:
    proc = bench("--repeat", "0", timeout=120)
    assert proc.returncode == 2 and "usage: streamer-bench" in proc.stderr


def test_synthetic_checkpoint_is_llama_like_and_reused(tmp_path: Path) -> None:
    import safetensors.torch

    made = synthetic.generate(tmp_path, 3 * MiB, 3)
    assert [f.name for f in made.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert 0.98 * 3 * MiB <= made.tensor_bytes <= 3 * MiB
    index = json.loads(made.index.read_text())
    tensors: dict[str, Any] = {}
    for f in made.files:
        tensors.update(safetensors.torch.load_file(f))
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == made.tensor_bytes
    h = made.shape.hidden
    assert tensors["model.embed_tokens.weight"].shape == (made.shape.vocab, h)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (h, made.shape.intermediate)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (made.shape.kv_dim, h)
    assert (
        tensors["lm_head.weight"].dtype.is_floating_point
        and str(tensors["lm_head.weight"].dtype) == "torch.bfloat16"
    )
    assert bool(tensors["model.norm.weight"].eq(1).all())
    assert 0.01 < float(tensors["model.layers.0.mlp.up_proj.weight"].float().std()) < 0.03
    assert resolve(str(made.index)).tensor_bytes == made.tensor_bytes
    assert synthetic.generate(tmp_path, 3 * MiB, 3).reused
    assert not synthetic.generate(tmp_path, 3 * MiB, 2).reused


@pytest.mark.parametrize("jobs", [1, 2, 3, 8])
@pytest.mark.parametrize("direct", [False, True])
def test_read_plan_covers_every_file(tmp_path: Path, jobs: int, direct: bool) -> None:
    files = []
    for i, size in enumerate((5 * MiB + 12345, 3 * MiB, 4096 * 3)):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"\0" * size)
        files.append(path)
    waves = ceilings._slices(files, jobs, direct)
    assert all(len(wave) <= max(jobs, len(files)) for wave in waves)
    for f in files:
        pieces = sorted((o, n) for wave in waves for (p, o, n) in wave if p == f)
        assert pieces[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(pieces))
        covered, size = sum(n for _, n in pieces), f.stat().st_size
        if direct:  # O_DIRECT lengths are whole 4 KiB blocks: each piece may drop a partial tail
            assert size - 4096 * len(pieces) < covered <= size and all(n % 4096 == 0 for _, n in pieces)
        else:
            assert covered == size


def test_python_read_ceiling_without_fio(tmp_path: Path) -> None:
    made = synthetic.generate(tmp_path, 8 * MiB, 2)
    found = ceilings.storage_ceilings(made.files, "warm", lambda: None, use_fio=False)
    assert [c.name for c in found] == ["read_buffered", "read_direct"]
    assert all(c.method == "python" and c.gbps and c.gbps > 0 for c in found)
    assert [s["jobs"] for s in found[0].samples] == list(ceilings.JOB_COUNTS)


def test_a_ceiling_sample_whose_preparation_fails_is_an_error_not_a_crash(tmp_path: Path) -> None:
    made = synthetic.generate(tmp_path, 8 * MiB, 2)
    prepared = 0

    def flaky_prepare() -> None:
        nonlocal prepared
        prepared += 1
        if prepared == 2:
            raise pagecache.CacheStateError("files could not be fully cached")

    (found,) = ceilings.storage_ceilings(
        made.files, "warm", flaky_prepare, modes=("buffered",), use_fio=False
    )
    assert [s.get("error") for s in found.samples] == [None, "files could not be fully cached", None]
    assert found.gbps is not None and found.gbps > 0


def test_make_warm_reads_again_what_went_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages reclaimed between the read and the check are read again, not reported as a failure."""
    made = synthetic.generate(tmp_path, 8 * MiB, 2)
    sizes = {path: path.stat().st_size for path in made.files}
    short = sizes[made.files[0]] - 4096
    answers = iter([0, short, short])  # first file: nothing cached, then a page short after its read
    reads: list[Path] = []

    def resident(path: Path) -> int:
        return next(answers, sizes[path]) if path == made.files[0] else sizes[path]

    monkeypatch.setattr(pagecache, "resident_bytes", resident)
    monkeypatch.setattr(pagecache, "_read_through", reads.append)
    assert pagecache.make_warm(made.files) == 0
    assert reads == [made.files[0], made.files[0]]


def test_read_ceiling_is_the_best_median_not_the_best_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One lucky run must not set the ceiling: each reader count's median counts."""
    made = synthetic.generate(tmp_path, 8 * MiB, 2)
    seconds = iter([1.0, 2.0, 2.0, 0.1, 2.0, 2.0, 1.0, 2.0, 2.0])  # rounds x (2, 4, 8)

    def fake_rate(waves: list[list[tuple[Path, int, int]]], direct: bool) -> tuple[int, float]:
        return 1_000_000_000, next(seconds)

    monkeypatch.setattr(ceilings, "_python_rate", fake_rate)
    rounds: list[str] = []
    (found,) = ceilings.storage_ceilings(
        made.files, "warm", lambda: rounds.append("prepared"), modes=("buffered",), use_fio=False, repeat=3
    )
    assert [s["jobs"] for s in found.samples] == list(ceilings.JOB_COUNTS) * 3  # rounds interleave counts
    assert len(rounds) == 9
    assert found.gbps == pytest.approx(1.0)  # 2 jobs: 1, 10, 1 GB/s -> median 1; never the lucky 10
    assert found.detail.startswith("2 job(s), 1 MiB reads, median of 3 (min-max 1.00-10.00)")


def _timed_child(seconds: dict[str, Any]) -> Any:
    """A child that reports ``seconds[loader](round)`` for each run, without loading anything."""
    rounds: dict[str, int] = {}

    def child(
        request: dict[str, Any], env: dict[str, str], timeout: float, python: str | None
    ) -> dict[str, Any]:
        loader = request["loader"]
        rounds[loader] = rounds.get(loader, 0) + 1
        took = seconds[loader](rounds[loader])
        return {
            "ok": True, "seconds": took, "process_seconds": took + 1, "bytes": 1 << 30, "tensors": 1,
            "peak_rss_bytes": 1 << 30, "resident_at_start_bytes": None, "metrics": {}, "notes": [],
            "minor_faults": 0, "cpu_seconds": took,
        }  # fmt: skip

    return child


@pytest.mark.parametrize(
    ("peer_seconds", "runs", "why"),
    [
        (lambda r: 2.0 + r / 100, 5, "every verdict decided after 5 rounds"),  # clearly behind us
        (lambda r: 1.0 + (-1) ** r / 10, 8, "8 rounds, the most asked for"),  # never separable
    ],
)
def test_a_cache_state_ends_once_every_verdict_is_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peer_seconds: Any, runs: int, why: str
) -> None:
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    files, index = [str(f) for f in made.files], str(made.index)
    configs = [
        runner.Config(Setting("streamer"), files, index),
        runner.Config(Setting("safetensors"), files, index),
    ]
    monkeypatch.setattr(runner, "_prepare", lambda config, state: (0, None))
    monkeypatch.setattr(
        runner, "call_child", _timed_child({"streamer": lambda r: 1.0, "safetensors": peer_seconds})
    )
    stopped = runner.run_section(
        configs, "warm", 8, device="cpu", streamer_api="open", timeout=60, progress=lambda _: None,
        min_rounds=5, undecided=lambda: report.undecided("warm", configs),
    )  # fmt: skip
    assert [len(c.runs) for c in configs] == [runs, runs]
    assert stopped.startswith(why)


def test_a_peer_whose_verdict_is_decided_stops_while_another_stays_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors is clearly behind after the 5 minimum rounds: its rounds end there and its
    verdict stands on them, while Run:ai's, never separable, runs to --repeat."""
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    files, index = [str(f) for f in made.files], str(made.index)
    loaders = ("streamer", "safetensors", "runai")
    configs = [runner.Config(Setting(loader), files, index) for loader in loaders]
    seconds = {
        "streamer": lambda r: 1.0,
        "safetensors": lambda r: 2.0 + r / 100,  # clearly behind
        "runai": lambda r: 1.0 + (-1) ** r / 10,  # never separable
    }
    monkeypatch.setattr(runner, "_prepare", lambda config, state: (0, None))
    monkeypatch.setattr(runner, "call_child", _timed_child(seconds))
    said: list[str] = []
    stopped = runner.run_section(
        configs, "warm", 8, device="cpu", streamer_api="open", timeout=60, progress=said.append,
        min_rounds=5, undecided=lambda: report.undecided("warm", configs),
    )  # fmt: skip
    assert [len(c.runs) for c in configs] == [8, 5, 8]
    assert stopped == "8 rounds, the most asked for (--repeat); some verdicts undecided"
    assert configs[1].retired is not None and configs[1].retired.startswith("not run after round 5")
    assert "[warm] safetensors default: not run after round 5: its verdict was decided" in "\n".join(said)
    assert configs[0].retired is None and configs[2].retired is None
    section = report.section("warm", configs, [])
    verdicts = {c["loader"]: (c["rounds"], c["verdict"]) for c in section["comparisons"]}
    assert verdicts == {"safetensors": (5, "ahead"), "runai": (8, "not separable")}
    assert [r["loader"] for r in section["best"]] == ["streamer", "safetensors", "runai"]


def _streamer_and_safetensors(tmp_path: Path) -> list[runner.Config]:
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    files, index = [str(f) for f in made.files], str(made.index)
    return [runner.Config(Setting(loader), files, index) for loader in ("streamer", "safetensors")]


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_time_budget_ends_a_state_when_the_next_round_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run takes 2 s: 4 s a round. With 30 s and 2 later runs plus 2 s kept for later, a
    round starting at 20 s (4 + 4 + 2 more) still fits, one starting at 24 s does not: 6 rounds,
    never separable, so the verdict stays undecided and the reason says the budget ended it."""
    configs = _streamer_and_safetensors(tmp_path)
    clock = _FakeClock()
    child = _timed_child({"streamer": lambda r: 1.0, "safetensors": lambda r: 1.0 + (-1) ** r / 10})

    def two_seconds(*args: Any) -> dict[str, Any]:
        clock.now += 2.0
        return child(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(runner, "_prepare", lambda config, state: (0, None))
    monkeypatch.setattr(runner, "call_child", two_seconds)
    stopped = runner.run_section(
        configs, "warm", 10, device="cpu", streamer_api="open", timeout=60, progress=lambda _: None,
        min_rounds=5, undecided=lambda: report.undecided("warm", configs),
        budget=runner.TimeBudget(30.0, later_runs=2, later_seconds=2.0, clock=clock),
    )  # fmt: skip
    assert [len(c.runs) for c in configs] == [6, 6]
    assert stopped == "6 rounds: another would not end within --time-budget; some verdicts undecided"


@pytest.mark.parametrize(("peer_seconds", "runs"), [(lambda r: 1.0 + (-1) ** r / 10, 5), (lambda r: 2.0, 5)])
def test_a_budget_too_small_still_runs_the_minimum_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peer_seconds: Any, runs: int
) -> None:
    configs = _streamer_and_safetensors(tmp_path)
    clock = _FakeClock()
    child = _timed_child({"streamer": lambda r: 1.0, "safetensors": peer_seconds})

    def one_second(*args: Any) -> dict[str, Any]:
        clock.now += 1.0
        return child(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(runner, "_prepare", lambda config, state: (0, None))
    monkeypatch.setattr(runner, "call_child", one_second)
    runner.run_section(
        configs, "warm", 10, device="cpu", streamer_api="open", timeout=60, progress=lambda _: None,
        min_rounds=5, undecided=lambda: report.undecided("warm", configs),
        budget=runner.TimeBudget(1.0, clock=clock),
    )  # fmt: skip
    assert [len(c.runs) for c in configs] == [runs, runs]


def _main_job_settings() -> list[tuple[Setting, list[str]]]:
    """The main job's settings: streamer, into=touched (cold only), safetensors, Run:ai's two."""
    sync_buffered = Setting("runai", (("strategy", "sync_buffered"),))
    settings = [Setting("streamer"), INTO_SETTING, Setting("safetensors"), Setting("runai"), sync_buffered]
    return [(setting, ["a"]) for setting in settings]


def test_the_budget_of_a_state_keeps_the_later_states_minimum_rounds() -> None:
    """Cold, run first, keeps warm's 5 rounds of 4 settings (into=touched is cold only), each at
    cold's cost a run, and warm's fio runs (buffered: 3 reader counts x 2), then the memory
    ceilings. Warm, run last, keeps only the memory ceilings."""
    args = arguments.parse_args(["--synthetic", "1MiB", "--time-budget", "300", "--settle", "3"])
    planned = _main_job_settings()
    cold = cli.time_budget(args, 100.0, planned, ["warm"])
    assert cold is not None and cold.end == 400.0
    assert cold.later_runs == 5 * 4
    warm_ceilings = cli.ceiling_seconds(args, "warm")
    assert warm_ceilings == pytest.approx(3 * args.ceiling_repeat * cli.FIO_RUN_SECONDS)
    assert cold.later_seconds == pytest.approx(warm_ceilings + cli.MEMORY_CEILINGS_SECONDS)
    buffered = 3 * args.ceiling_repeat + 5
    assert cli.ceiling_seconds(args, "cold") == pytest.approx(
        (buffered + 3 * args.ceiling_repeat) * cli.FIO_RUN_SECONDS + buffered * 3.0
    )
    warm = cli.time_budget(args, 100.0, planned, [])
    assert warm is not None and warm.later_runs == 0 and warm.later_seconds == cli.MEMORY_CEILINGS_SECONDS
    assert cli.time_budget(arguments.parse_args(["--time-budget", "none"]), 0.0, planned, ["warm"]) is None


def test_cold_keeps_what_warm_took_in_the_06_46_main_job() -> None:
    """The main job of 2026-12-02 06:46: warm's 5 rounds and its ceilings took 100 s (from the first
    ceiling to the last run), cold's runs came 5.7 s apart. Run first, cold keeps at least that for
    warm, and the memory ceilings after it."""
    args = arguments.parse_args(["--synthetic", "1MiB", "--time-budget", "300"])
    cold = cli.time_budget(args, 0.0, _main_job_settings(), ["warm"])
    assert cold is not None
    assert cold.later_runs * 5.7 + cold.later_seconds >= 100.0 + cli.MEMORY_CEILINGS_SECONDS


@pytest.mark.parametrize("budget", ["300", "none"])
def test_cold_runs_first_and_warm_takes_the_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: str
) -> None:
    """Warm, run last, keeps nothing back for a later state's rounds (only the memory ceilings);
    cold keeps warm's minimum rounds. The report lists the states in the order they ran."""
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    checkpoint = CheckpointFiles(str(made.index), list(made.files), 256 * 1024, 1)
    args = arguments.parse_args(["--synthetic", "1MiB", "--time-budget", budget, "--no-ceilings"])
    args.ceilings = True  # what the budget keeps for them, without measuring any
    planned = [(Setting("streamer"), [str(f) for f in made.files])]
    budgets: dict[str, runner.TimeBudget | None] = {}

    def run_section(configs: list[runner.Config], state: str, *args: Any, **options: Any) -> str:
        budgets[state] = options["budget"]
        return "stopped"

    monkeypatch.setattr(runner, "run_section", run_section)
    monkeypatch.setattr(ceilings, "storage_ceilings", lambda *args, **options: [])
    monkeypatch.setattr(cli, "memory_ceilings", lambda *args: [])
    sections, _, stop = cli.measure(args, checkpoint, planned, {}, cli.Progress(quiet=True))
    assert stop is None and list(budgets) == ["cold", "warm"]
    assert [section["cache"] for section in sections] == ["cold", "warm"]
    cold, warm = budgets["cold"], budgets["warm"]
    if budget == "none":
        assert cold is None and warm is None
    else:
        assert cold is not None and cold.later_runs == 5
        assert warm is not None and warm.later_runs == 0 and warm.later_seconds == cli.MEMORY_CEILINGS_SECONDS


@pytest.mark.parametrize("ceilings_on", [True, False])
def test_fresh_memory_is_timed_before_each_round_and_a_slow_round_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ceilings_on: bool
) -> None:
    """Before each round's loads (both states), the bench times the first touch of fresh memory;
    the report names a round where it fell under half its median (a host handing memory out
    slowly slows every loader there). --no-ceilings measures none."""
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    checkpoint = CheckpointFiles(str(made.index), list(made.files), 256 * 1024, 1)
    args = arguments.parse_args(["--synthetic", "1MiB", "--time-budget", "none", "--no-ceilings"])
    args.ceilings = ceilings_on
    planned = [(Setting("streamer"), [str(f) for f in made.files])]
    touch_seconds = iter([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])

    def run_section(configs: list[runner.Config], state: str, *args: Any, **options: Any) -> str:
        if options["each_round"] is not None:
            for r in range(3):
                options["each_round"](r)
        return "stopped"

    monkeypatch.setattr(runner, "run_section", run_section)
    monkeypatch.setattr(ceilings, "storage_ceilings", lambda *args, **options: [])
    monkeypatch.setattr(ceilings, "first_touch_seconds", lambda size: next(touch_seconds))
    monkeypatch.setattr(cli, "memory_ceilings", lambda *args: [])
    sections, _, _ = cli.measure(args, checkpoint, planned, {}, cli.Progress(quiet=True))
    cold, warm = sections
    if not ceilings_on:
        assert cold["first_touch_rounds"] == [] and warm["first_touch_rounds"] == []
        assert report._first_touch_line(cold) is None
        return
    probe = ceilings.FIRST_TOUCH_PROBE
    assert cold["first_touch_rounds"] == [
        {"round": r, "gbps": pytest.approx(probe / s / 1e9)} for r, s in enumerate([0.1, 0.5, 0.1])
    ]
    assert [r["round"] for r in warm["first_touch_rounds"]] == [0, 1, 2]
    line = report._first_touch_line(cold)
    assert line is not None
    assert line.startswith("-- cold: first touch of fresh memory before each round (GB/s): 2.68 0.54 2.68;")
    assert line.endswith("under half its median before round(s) 2: memory came slowly there")
    steady = report._first_touch_line(warm)
    assert steady is not None and "slowly" not in steady


def test_cold_loads_are_divided_by_the_ceiling_of_their_own_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk drifts within a section: the read ceiling is measured again before each round, and
    each round's load is divided by its own round's ceiling (paired, as the verdicts are)."""
    made = synthetic.generate(tmp_path, 256 * 1024, 1)
    files, index = [str(f) for f in made.files], str(made.index)
    configs = [runner.Config(Setting("streamer"), files, index)]
    slow_disk = {1: 2.0, 2: 1.0, 3: 2.0, 4: 1.0, 5: 2.0}  # the disk halves its speed every other round
    monkeypatch.setattr(runner, "_prepare", lambda config, state: (0, None))
    monkeypatch.setattr(runner, "call_child", _timed_child({"streamer": lambda r: 0.625 * slow_disk[r]}))
    ceiling = ceilings.Ceiling("read_direct", "cold", 1.0, "python", "", jobs=2)
    speeds = iter([1.0, 2.0, 1.0, 2.0, 1.0])  # GB/s of the same files read by the ceiling's readers
    measured: list[int] = []

    def each_round(r: int) -> None:
        measured.append(len(configs[0].runs))  # before the round's loads
        ceiling.rounds.append({"round": r, "gbps": next(speeds) * 1.073741824})

    runner.run_section(
        configs, "cold", 5, device="cpu", streamer_api="open", timeout=60, progress=lambda _: None,
        each_round=each_round,
    )  # fmt: skip
    assert measured == [0, 1, 2, 3, 4]
    results = [report.summarize(c) for c in configs]
    (pair,) = report.ceiling_pairs(results, [ceiling])
    assert pair["setting"] == "default" and pair["rounds"] == 5 and pair["jobs"] == 2
    assert pair["ratio"] == pytest.approx(0.8) and pair["low"] == pytest.approx(0.8)  # steady; GB/s is not
    text = report.render(
        {"checkpoint": {"files": files, "tensor_bytes": 1 << 30, "tensor_count": 1, "source": index},
         "options": {"device": "cpu", "repeat": 5}, "machine": {"filesystem": {"type": "ext4"}},
         "sections": [report.section("cold", configs, [ceiling])], "memory_ceilings": [], "skipped": []}
    )  # fmt: skip
    assert "-- cold: streamer ÷ read ceiling, paired by round (GB/s over read_direct at 2 job(s)" in text
    assert "  streamer default: 0.80x [0.80, 0.80] over 5 rounds" in text


def test_a_ceiling_measured_before_each_round_is_the_median_of_all_its_runs() -> None:
    """The table divides by the median of every run at the ceiling's reader count: those before
    the section (other reader counts left out) and those before the rounds."""
    ceiling = ceilings.Ceiling("read_buffered", "cold", 2.5, "fio", "8 job(s)", jobs=8)
    ceiling.samples = [{"jobs": 4, "gbps": 9.0}, {"jobs": 8, "gbps": 2.0}, {"jobs": 8, "gbps": 3.0}]
    ceiling.samples.append({"jobs": 8, "error": "eviction left pages resident"})
    ceiling.rounds = [{"round": r, "gbps": g} for r, g in enumerate([1.0, 1.2, 1.4])]
    ceilings.fold_rounds(ceiling)
    assert ceiling.gbps == pytest.approx(1.4)  # of 1.0, 1.2, 1.4, 2.0 and 3.0: the 4-job 9.0 is not one
    assert ceiling.detail == (
        "8 job(s), 1 MiB reads, median of 5: 2 before the section, 3 before its rounds (min-max 1.00-3.00)"
    )
    unmeasured = ceilings.Ceiling("read_direct", "cold", 1.1, "fio", "2 job(s)", jobs=2)
    ceilings.fold_rounds(unmeasured)
    assert (unmeasured.gbps, unmeasured.detail) == (1.1, "2 job(s)")


def test_measure_round_reads_at_the_ceiling_s_best_reader_count(tmp_path: Path) -> None:
    made = synthetic.generate(tmp_path, 8 * MiB, 2)
    (found,) = ceilings.storage_ceilings(made.files, "warm", lambda: None, modes=("buffered",), use_fio=False)
    assert found.jobs in ceilings.JOB_COUNTS
    prepared: list[str] = []
    ceilings.measure_round(found, made.files, lambda: prepared.append("prepared"), 3)
    assert prepared == ["prepared"] and [r["round"] for r in found.rounds] == [3]
    assert found.rounds[0]["gbps"] > 0


def test_the_machine_s_dirty_pages_are_written_out_before_the_first_timed_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Writeback of what was written just before (an install) must not land in the first rounds."""
    events: list[str] = []
    monkeypatch.setattr(cli.os, "sync", lambda: events.append("sync"))
    monkeypatch.setattr(cli, "run_sections", lambda *args: events.append("runs"))
    monkeypatch.setattr(cli, "memory_ceilings", lambda *args: events.append("memory") or [])
    args = arguments.parse_args(["--synthetic", "1MiB"])
    cli.measure(args, None, [], {}, cli.Progress(True))  # type: ignore[arg-type]
    assert events == ["sync", "runs", "memory"]


def test_a_buffered_cold_ceiling_run_starts_after_the_settle_as_a_load_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffered cold read fills the page cache with memory the VM may have handed back, as the
    loads' memory is: it waits the settle after its eviction. O_DIRECT and warm runs fill none."""
    made = synthetic.generate(tmp_path, 8 * MiB, 2)
    events: list[str] = []
    monkeypatch.setattr(ceilings.time, "sleep", lambda seconds: events.append(f"settle {seconds}"))
    found = ceilings.storage_ceilings(
        made.files, "cold", lambda: events.append("evicted"), use_fio=False, settle=3.0
    )
    per_mode = len(ceilings.JOB_COUNTS)
    assert events == ["evicted", "settle 3.0"] * per_mode + ["evicted"] * per_mode  # buffered, then direct
    events.clear()
    ceilings.measure_round(found[0], made.files, lambda: events.append("evicted"), 0, settle=3.0)
    ceilings.measure_round(found[1], made.files, lambda: events.append("evicted"), 0, settle=3.0)
    assert events == ["evicted", "settle 3.0", "evicted"]
    events.clear()
    ceilings.storage_ceilings(made.files, "warm", lambda: events.append("cached"), use_fio=False, settle=3.0)
    assert events == ["cached"] * 2 * per_mode


IMPORT_TIME = Path(__file__).resolve().parent.parent / "benchmarks" / "import_time.py"


def _import_time_module() -> Any:
    spec = importlib.util.spec_from_file_location("import_time", IMPORT_TIME)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_import_benchmark_times_an_installed_import_after_torch_and_wants_five_rounds() -> None:
    assert 0 < _import_time_module().import_seconds("streamer") < 30  # from /: the installed package
    done = subprocess.run(
        [sys.executable, str(IMPORT_TIME), "--repeat", "4"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "at least 5 rounds" in done.stderr


def test_the_import_benchmark_names_an_import_that_fails_and_pairs_the_others(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _import_time_module()
    timed = {"streamer": 0.030, "safetensors.torch": 0.002}

    def import_seconds(name: str, python: str = sys.executable) -> float:
        if name not in timed:
            raise subprocess.CalledProcessError(1, [python], stderr="ModuleNotFoundError: no runai here\n")
        return timed[name]

    monkeypatch.setattr(module, "import_seconds", import_seconds)
    monkeypatch.setattr(sys, "argv", ["import_time.py", "--repeat", "5"])
    assert module.main() == 0
    out = capsys.readouterr().out
    assert "runai: not timed, `import runai_model_streamer` fails: ModuleNotFoundError: no runai here" in out
    assert "streamer     median   30.0 ms" in out
    assert "safetensors ÷ streamer: 0.07x" in out and "over 5 rounds: behind" in out


class _KeptOnClose(mmap.mmap):
    """An anonymous mapping that appends its bytes to ``kept`` when closed, before it is unmapped."""

    def __new__(cls, size: int, kept: list[bytes]) -> _KeptOnClose:
        region = super().__new__(cls, -1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.kept = kept
        return region

    def close(self) -> None:
        self.kept.append(bytes(self))
        super().close()


def test_the_page_fill_ceiling_places_every_byte_or_says_why_it_was_not_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ceiling's fill really places the source's bytes into fresh pages from every thread; where
    userfaultfd is refused (as streamer's page fill would be), it names why instead of a figure."""
    import numpy as np

    from streamer.engine.native import PageFill

    fill, refused = PageFill.open()
    if fill is None:
        assert ceilings.page_fill_ceiling(8 << 20).error == f"not measured: {refused}"
        return
    source = np.random.default_rng(7).integers(0, 256, 5 << 20, dtype=np.uint8)
    placed: list[bytes] = []
    monkeypatch.setattr(ceilings, "_aligned_buffer", lambda size: _KeptOnClose(size, placed))
    try:
        assert ceilings.page_fill_seconds(source, 3, fill) > 0
    finally:
        fill.close()
    assert placed == [source.tobytes()]
    monkeypatch.undo()

    measured = ceilings.page_fill_ceiling((8 << 20) + 100)  # whole pages only
    assert measured.name == "page_fill" and measured.error is None and measured.gbps and measured.gbps > 0
    assert measured.detail.startswith("8 MiB, 4 KiB pages, ") and measured.method == "userfaultfd"
    monkeypatch.setattr(PageFill, "open", classmethod(lambda cls: (None, "userfaultfd refused: EPERM")))
    refused_here = ceilings.page_fill_ceiling(8 << 20)
    assert refused_here.gbps is None and refused_here.error == "not measured: userfaultfd refused: EPERM"

    def unbuilt(cls: type) -> None:
        raise ImportError("streamer's native engine is missing")

    monkeypatch.setattr(PageFill, "open", classmethod(unbuilt))
    unbuilt_here = ceilings.page_fill_ceiling(8 << 20)
    assert unbuilt_here.gbps is None
    assert unbuilt_here.error == "not measured: streamer's native engine is missing"


def test_python_m_streamer_bench_imports_the_installed_streamer_from_a_checkout(tmp_path: Path) -> None:
    """``python -m streamer_bench`` run where a ``streamer/`` source tree lies (a checkout's root,
    as ``benchmarks/s3_load.py`` runs it) imports the installed streamer, not that tree."""
    shadow = tmp_path / "streamer"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the source tree, not the installed streamer')\n")
    command = [sys.executable, "-m", "streamer_bench", "--help"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: streamer-bench" in done.stdout

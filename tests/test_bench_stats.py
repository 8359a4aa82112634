"""The paired verdicts of streamer-bench: rounds pair up, intervals are reproducible, verdicts honest."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from streamer_bench import report, runner, stats
from streamer_bench.ceilings import Ceiling
from streamer_bench.loaders import INTO_SETTING, Setting, settings_for
from streamer_bench.runner import Config, Run


def test_ratios_pair_runs_of_the_same_round_only() -> None:
    ours = {0: 1.0, 1: 2.0, 3: 1.0}
    theirs = {0: 1.5, 1: 2.0, 2: 9.0, 3: 0.5}
    assert stats.paired_ratios(ours, theirs) == [1.5, 1.0, 0.5]


def test_interval_is_reproducible_and_contains_the_median() -> None:
    rng = random.Random(7)
    values = [1.2 + rng.gauss(0, 0.1) for _ in range(20)]
    low, high = stats.bootstrap_median_interval(values)
    assert (low, high) == stats.bootstrap_median_interval(values)
    assert low < sorted(values)[10] < high


@pytest.mark.parametrize(
    ("peer_times", "verdict"),
    [
        ([1.5, 1.6, 1.4, 1.55, 1.45, 1.5, 1.6, 1.5], "ahead"),
        ([0.7, 0.72, 0.69, 0.71, 0.7, 0.73, 0.68, 0.7], "behind"),
        ([0.8, 1.25, 0.9, 1.2, 0.85, 1.15, 1.0, 1.1], "not separable"),
    ],
)
def test_verdicts(peer_times: list[float], verdict: str) -> None:
    ours = dict.fromkeys(range(len(peer_times)), 1.0)
    result = stats.compare(ours, dict(enumerate(peer_times)))
    assert result.verdict == verdict
    assert result.rounds == len(peer_times)
    assert result.low is not None and result.high is not None and result.low <= result.ratio <= result.high


def test_a_noisy_round_does_not_decide_the_verdict() -> None:
    """One round where the machine stalled our run (10x slower) must not flip a clear lead."""
    peer = [1.5] * 10
    ours = [1.0] * 9 + [10.0]
    result = stats.compare(dict(enumerate(ours)), dict(enumerate(peer)))
    assert result.ratio == pytest.approx(1.5) and result.verdict == "ahead"


def test_too_few_rounds_give_no_verdict() -> None:
    result = stats.compare({0: 1.0, 1: 1.0}, {0: 2.0, 1: 2.0})
    assert result.verdict == "too few rounds" and result.ratio == pytest.approx(2.0) and result.low is None
    assert stats.compare({0: 1.0}, {1: 1.0}).ratio is None


def _config(
    loader: str,
    knobs: tuple[tuple[str, str | int], ...],
    seconds: list[float | None],
    cpu_seconds: list[float] | None = None,
) -> Config:
    config = Config(Setting(loader, knobs), ["x.safetensors"], "x")
    cpu = cpu_seconds or [0.5] * len(seconds)
    for i, value in enumerate(seconds):
        if value is None:
            config.runs.append(Run(i, False, error="FAILED"))
        else:
            run = Run(i, True, value, 1 << 30, 1, 1 << 20, minor_faults=2000, cpu_seconds=cpu[i])
            config.runs.append(run)
    return config


def test_section_compares_streamer_with_each_peer_at_its_best() -> None:
    configs = [
        _config("streamer", (), [1.0] * 6),
        _config("runai", (), [2.0] * 6),
        _config("runai", (("concurrency", 16),), [1.2, 1.3, None, 1.2, 1.25, 1.3]),  # its best; 1 failed
        _config("safetensors", (("backend", "mmap"),), [0.9] * 6),
    ]
    section = report.section("cold", configs, [])
    by_loader = {c["loader"]: c for c in section["comparisons"]}
    assert set(by_loader) == {"runai", "safetensors"}
    assert by_loader["runai"]["setting"] == "concurrency=16" and by_loader["runai"]["rounds"] == 5
    assert by_loader["runai"]["verdict"] == "ahead"
    assert by_loader["safetensors"]["verdict"] == "behind"
    ours = section["results"][0]
    assert ours["faults_per_gib"] == pytest.approx(2000) and ours["cpu_s"] == 0.5


def test_the_machines_cpus_while_streamer_loaded_are_reported_and_say_when_they_bound_it() -> None:
    """A load's own CPU seconds miss the cores a local S3 server takes: the whole machine's busy
    cores (medians over streamer's runs) say whether the CPUs, not the store, bound the run."""

    def with_machine(config: Config, busy: list[float], stolen: float) -> Config:
        for run, cores in zip(config.runs, busy, strict=True):
            run.machine_busy_cores, run.machine_stolen_cores, run.load_seconds = cores, stolen, run.seconds
        return config

    configs = [
        # one run's own CPU counted above the machine's busy ticks: never more than the machine
        with_machine(
            _config("streamer", (), [1.0] * 5, [1.2] * 4 + [2.1]), [1.9, 1.95, 1.85, 2.0, 1.9], 0.02
        ),
        _config("runai", (), [2.0] * 5),  # no machine figures (an older child): no effect
    ]
    section = report.section("remote", configs, [])
    ours = section["results"][0]
    assert ours["machine_busy_cores"] == pytest.approx(1.9) and ours["load_cores"] == pytest.approx(1.2)
    assert section["results"][1]["machine_busy_cores"] is None
    over = report.summarize(with_machine(_config("streamer", (), [1.0], [2.1]), [1.9], 0.0))
    assert over["load_cores"] == pytest.approx(1.9)  # its own CPU counted above the machine's ticks
    line = report._cores_line(section, 2)
    assert line == (
        "-- remote: the machine's CPUs while streamer loaded: 1.90 of 2 busy (1.20 of them the "
        "load's own), 0.02 taken by the hypervisor (medians); the CPUs bound the run"
    )
    roomy = report._cores_line(section, 4)  # 1.9 of 4 cores: room to grow
    assert roomy is not None and "bound" not in roomy
    assert report._cores_line(report.section("remote", configs[1:], []), 2) is None


def test_cpu_seconds_are_paired_beside_the_wall_time() -> None:
    """Where both clocks are bound by the disk, the CPU verdict still tells the loaders apart."""
    walls = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0]
    configs = [
        _config("streamer", (), walls, cpu_seconds=[0.5, 0.6, 0.5, 0.55, 0.5, 0.5]),
        _config(
            "runai",
            (),
            [w * s for w, s in zip(walls, [0.9, 1.1, 1.0, 1.05, 0.95, 1.0], strict=True)],
            cpu_seconds=[1.5, 1.6, 1.4, 1.7, 1.5, 1.5],
        ),
    ]
    section = report.section("cold", configs, [])
    (compared,) = section["comparisons"]
    assert compared["verdict"] == "not separable"
    cpu = compared["cpu"]
    assert cpu["verdict"] == "ahead" and cpu["rounds"] == 6 and cpu["low"] > 2.5
    assert cpu["ratio"] == pytest.approx(3.0, rel=0.1)
    document = {
        "checkpoint": {"files": ["x.safetensors"], "tensor_bytes": 1 << 30, "tensor_count": 1, "source": "x"},
        "options": {"device": "cpu", "repeat": 6},
        "machine": {"filesystem": {"type": "ext4"}},
        "sections": [section],
        "memory_ceilings": [],
        "skipped": [],
    }
    line = next(x for x in report.render(document).splitlines() if x.startswith("  runai"))
    assert "NOT SEPARABLE (CPU seconds 3.00x [" in line
    assert line.endswith("]: AHEAD); per round: 0.90x 1.10x 1.00x 1.05x 0.95x 1.00x")


def test_an_open_verdict_lists_its_rounds_and_a_decided_one_does_not() -> None:
    """Round 2's streamer run was slowed (a disturbed host: 5 s where the others took 0.5 s): the
    interval of 5 rounds then reaches below 1, and the line shows which round held it open."""
    configs = [
        _config("streamer", (), [0.5, 5.0, 0.5, 0.5, 0.5]),
        _config("safetensors", (), [0.9, 0.9, 0.9, 0.9, 0.9]),
        _config("runai", (), [2.0, 10.0, 2.0, 2.0, 2.0]),
    ]
    section = report.section("cold", configs, [])
    by_loader = {c["loader"]: c for c in section["comparisons"]}
    assert by_loader["safetensors"]["verdict"] == "not separable"
    assert by_loader["safetensors"]["per_round"] == pytest.approx([1.8, 0.18, 1.8, 1.8, 1.8])
    assert by_loader["runai"]["verdict"] == "ahead"
    lines = [report._comparison_line(c) for c in section["comparisons"]]
    safetensors, runai = sorted(lines, key=lambda line: "runai" in line)
    assert safetensors.endswith("; per round: 1.80x 0.18x 1.80x 1.80x 1.80x")
    assert "per round" not in runai


def test_runs_without_cpu_seconds_give_no_cpu_verdict() -> None:
    configs = [_config("streamer", (), [1.0] * 6), _config("runai", (), [2.0] * 6)]
    for run in configs[1].runs:
        run.cpu_seconds = None
    (compared,) = report.section("warm", configs, [])["comparisons"]
    assert compared["verdict"] == "ahead" and compared["cpu"]["ratio"] is None
    assert "CPU" not in report._comparison_line(compared)


def test_every_row_shows_its_share_of_the_read_ceiling_and_the_binding_ceiling_is_named() -> None:
    """1 GiB in 1 s is 1.07 GB/s: half a 2.15 GB/s read ceiling; first touch at 1.5 GB/s binds."""
    configs = [_config("streamer", (), [1.0] * 6), _config("runai", (), [2.0] * 6)]
    read = Ceiling("read_direct", "cold", 2.147, "fio", "8 jobs")
    section = report.section("cold", configs, [read])
    memory = [
        asdict(Ceiling("first_touch", None, 1.5, "mmap", "")),
        asdict(Ceiling("memcpy", None, 9.0, "numpy", "")),
    ]
    document = {
        "checkpoint": {"files": ["x.safetensors"], "tensor_bytes": 1 << 30, "tensor_count": 1, "source": "x"},
        "options": {"device": "cpu", "repeat": 6},
        "machine": {"filesystem": {"type": "ext4"}},
        "sections": [section],
        "memory_ceilings": memory,
        "skipped": [],
    }
    lines = report.render(document).splitlines()
    header = next(line for line in lines if line.startswith("loader"))
    row = next(line for line in lines if line.startswith("streamer  "))
    end = header.index("÷ ceiling") + len("÷ ceiling")  # numbers are right-aligned under their title
    assert row[end - 4 : end] == "0.50"
    assert any(line.startswith("-- cold: bound by first_touch at 1.50 GB/s") for line in lines)


def test_the_into_touched_row_is_shown_but_never_a_loaders_best() -> None:
    """load_into of touched tensors skips first touch: faster, but not a whole load to compare."""
    configs = [
        _config("streamer", (), [1.0] * 6),
        _config("streamer", (("into", "touched"),), [0.5] * 6),
        _config("runai", (), [2.0] * 6),
    ]
    section = report.section("cold", configs, [])
    assert [r["setting"] for r in section["results"]] == ["default", "into=touched", "default"]
    assert [(b["loader"], b["setting"]) for b in section["best"]] == [
        ("streamer", "default"),
        ("runai", "default"),
    ]
    assert section["reference"] == {"loader": "streamer", "setting": "default"}


def test_into_touched_is_a_streamer_setting_on_request_only() -> None:
    assert INTO_SETTING not in settings_for("streamer", [], ["default"], ["mmap"])
    assert settings_for("streamer", [], ["default"], ["mmap"], into_touched=True)[-1] == INTO_SETTING
    assert INTO_SETTING not in settings_for("runai", [], ["default"], ["mmap"], into_touched=True)


def test_a_ceiling_streamer_beat_is_not_named_as_its_bound() -> None:
    """Warm, streamer at 4.3 GB/s beats first touch (2.0): the load does not fault fresh pages in,
    so memcpy (9.0) bounds it, and the line says which ceiling streamer passed."""
    configs = [_config("streamer", (), [0.25] * 6), _config("runai", (), [1.0] * 6)]
    section = report.section("warm", configs, [Ceiling("read_buffered", "warm", 6.0, "fio", "8 jobs")])
    memory = [
        asdict(Ceiling("first_touch", None, 2.0, "mmap", "")),
        asdict(Ceiling("memcpy", None, 9.0, "numpy", "")),
    ]
    bound = report._binding_ceiling(section, memory)
    assert bound == {"name": "storage reads", "gbps": 6.0, "passed": [{"name": "first_touch", "gbps": 2.0}]}
    line = report._binding_line("warm", bound)
    assert line.startswith("-- warm: bound by storage reads at 6.00 GB/s")
    assert "streamer beat first_touch at 2.00 GB/s" in line
    everything = report._binding_ceiling(report.section("warm", configs, []), memory[:1])
    assert everything is not None and everything["name"] is None
    assert report._binding_line("warm", everything).startswith("-- warm: above every measured ceiling")


def test_a_load_that_filled_its_pages_is_bound_by_the_page_fill_not_by_first_touch() -> None:
    """Streamer's runs say they created their pages with the page fill: their path is the page fill
    (5.0), not first touch (2.0) then memcpy; warm at 4.3 GB/s it binds, cold at 2.1 GB/s too, once
    storage reads (1.7) were beaten, and at 6.1 GB/s it still binds (the ceiling ran slow). A load
    whose runs faulted their pages keeps the old path."""
    memory = [
        asdict(Ceiling("first_touch", None, 2.0, "mmap", "")),
        asdict(Ceiling("memcpy", None, 20.0, "numpy", "")),
        asdict(Ceiling("page_fill", None, 5.0, "userfaultfd", "")),
    ]
    for state, seconds, read, passed in (
        ("warm", 0.25, 30.0, []),
        ("warm", 0.175, 30.0, []),
        ("cold", 0.5, 1.7, [{"name": "storage reads", "gbps": 1.7}]),
    ):
        streamer = _config("streamer", (), [seconds] * 6)
        for run in streamer.runs:
            run.metrics = {"page_fill": "on"}
        configs = [streamer, _config("runai", (), [1.0] * 6)]
        section = report.section(state, configs, [Ceiling("read_buffered", state, read, "fio", "8 jobs")])
        bound = report._binding_ceiling(section, memory)
        assert bound == {"name": "page_fill", "gbps": 5.0, "passed": passed}
        faulted = report.section(state, [_config("streamer", (), [seconds] * 6)], [])
        assert report._binding_ceiling(faulted, memory)["passed"] == [{"name": "first_touch", "gbps": 2.0}]


def test_a_peer_setting_far_from_its_loaders_best_stops_after_the_first_rounds() -> None:
    """runai default at 1.5x runai's best after two rounds stops; a setting within 1.4x, streamer's
    own settings and a loader's only setting go on; the report says which stopped and why."""
    configs = [
        _config("streamer", (), [1.0, 1.0]),
        _config("streamer", (("hugepages", "0"),), [3.0, 3.0]),  # streamer's own: never pruned
        _config("runai", (), [3.0, 3.0]),
        _config("runai", (("strategy", "sync_buffered"),), [2.0, 2.0]),
        _config("safetensors", (), [1.3, 1.3]),
        _config("safetensors", (("backend", "pread"),), [1.6, 1.6]),  # 1.23x: close enough, runs on
    ]
    dropped = runner.prune(configs, 2)
    assert [(c.setting.loader, c.setting.label) for c in dropped] == [("runai", "default")]
    assert configs[2].pruned is not None and "1.50x" in configs[2].pruned
    section = report.section("cold", configs, [])
    best = {r["loader"]: r["setting"] for r in section["best"]}
    assert best["runai"] == "strategy=sync_buffered"
    pruned = {r["setting"]: r["pruned"] for r in section["results"] if r["loader"] == "runai"}
    assert pruned["default"] and pruned["strategy=sync_buffered"] is None

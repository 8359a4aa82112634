"""The paired verdicts of streamer-bench: rounds pair up, intervals are reproducible, verdicts honest."""

from __future__ import annotations

import random

import pytest

from streamer.bench import report, stats
from streamer.bench.loaders import Setting
from streamer.bench.runner import Config, Run


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


def _config(loader: str, knobs: tuple[tuple[str, str | int], ...], seconds: list[float | None]) -> Config:
    config = Config(Setting(loader, knobs), ["x.safetensors"], "x")
    for i, value in enumerate(seconds):
        if value is None:
            config.runs.append(Run(i, False, error="FAILED"))
        else:
            config.runs.append(Run(i, True, value, 1 << 30, 1, 1 << 20, minor_faults=2000, cpu_seconds=0.5))
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

"""Paired comparisons that survive a noisy machine.

On shared VMs the same loader's time varies 2x from run to run, so medians of a few runs do not
separate loaders 10-20% apart. Runs of every setting are interleaved in rounds, and a round's
runs share the machine's state; so each round gives one ratio (the peer's time divided by ours:
above 1, we were faster), and the verdict comes from the median of those ratios and its
bootstrap 95% interval: "ahead" only when the whole interval is above 1, "behind" when it is
below, otherwise "not separable".
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["ahead", "behind", "not separable", "too few rounds"]
MIN_ROUNDS = 5  # below this a bootstrap interval says nothing
_RESAMPLES = 10_000


@dataclass(frozen=True)
class PairedRatio:
    """The peer's time over ours, per round; ``ratio`` is their median, ``low``-``high`` its 95% interval,
    ``per_round`` every round's ratio in round order (one disturbed round can hold a verdict open)."""

    rounds: int
    ratio: float | None
    low: float | None
    high: float | None
    verdict: Verdict
    per_round: tuple[float, ...] = ()


def paired_ratios(ours: Mapping[int, float], theirs: Mapping[int, float]) -> list[float]:
    """``theirs[r] / ours[r]`` for every round ``r`` both have a valid time for, in round order."""
    return [theirs[r] / ours[r] for r in sorted(ours.keys() & theirs.keys()) if ours[r] > 0]


def bootstrap_median_interval(
    values: Sequence[float], *, confidence: float = 0.95, resamples: int = _RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval of the median (seeded: the same runs give the same interval)."""
    if not values:
        raise ValueError("no values to resample")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


def compare(ours: Mapping[int, float], theirs: Mapping[int, float]) -> PairedRatio:
    """The paired verdict of our seconds per round against a peer's."""
    ratios = paired_ratios(ours, theirs)
    if not ratios:
        return PairedRatio(0, None, None, None, "too few rounds")
    median = statistics.median(ratios)
    if len(ratios) < MIN_ROUNDS:
        return PairedRatio(len(ratios), median, None, None, "too few rounds", tuple(ratios))
    low, high = bootstrap_median_interval(ratios)
    verdict: Verdict = "ahead" if low > 1 else "behind" if high < 1 else "not separable"
    return PairedRatio(len(ratios), median, low, high, verdict, tuple(ratios))

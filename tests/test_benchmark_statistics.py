"""The statistics `benchmarks/ipc_transport.py` judges the transport's goals with: paired
ratios with a distribution-free 95% interval, and paths interleaved in a rotating order."""

from __future__ import annotations

import random
from types import ModuleType

import pytest

from tests.benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("ipc_transport")


def test_the_interval_covers_the_true_median_about_95_percent_of_the_time(bench):
    rng = random.Random(7)
    runs, covered, widths = 2000, 0, []
    for _ in range(runs):
        # ratios whose median is 1: lognormal noise on both sides of a pair
        numerators = [rng.lognormvariate(0, 0.2) for _ in range(100)]
        low, high = bench.paired_ratio(numerators, [1.0] * 100)["ci95"]
        covered += low <= 1 <= high
        widths.append(high - low)
    assert 0.93 <= covered / runs <= 0.98
    assert max(widths) < 0.3  # an interval, not the whole range of the samples


@pytest.mark.parametrize(("ratio", "expected"), [(1.08, "faster"), (0.92, "slower"), (1.0, "equal within noise")])
def test_verdicts_follow_the_interval(bench, ratio, expected):
    rng = random.Random(3)
    numerators = [ratio * rng.lognormvariate(0, 0.05) for _ in range(100)]
    result = bench.paired_ratio(numerators, [1.0] * 100)
    assert result["pairs"] == 100 and abs(result["median"] - ratio) < 0.02
    assert bench.verdict(result) == expected


def test_ratios_are_taken_pair_by_pair(bench):
    # Both paths drift the same way, in no order; pair by pair the ratio is 2 (30 pairs) or 3
    # (20 pairs, at the low drifts), which sorting either path on its own would mix up.
    drift = [1 + i * 7 % 50 for i in range(50)]
    fast = [float(d) for d in drift]
    slow = [(3.0 if d <= 20 else 2.0) * d for d in drift]
    assert bench.paired_ratio(slow, fast) == {"median": 2.0, "ci95": [2.0, 3.0], "pairs": 50}


def test_interleaving_rotates_the_order_and_pairs_iterations(bench):
    calls: list[str] = []
    counters = {"a": 0, "b": 0, "c": 0}

    def path(name: str):
        def run() -> dict[str, float]:
            calls.append(name)
            counters[name] += 1
            return {"ms": float(counters[name])}
        return run

    samples = bench.interleaved({name: path(name) for name in "abc"}, repeats=4, warmups=2)
    assert calls[:9] == list("abcbcacab")  # each iteration starts one path later
    assert {name: [s["ms"] for s in values] for name, values in samples.items()} == {
        name: [3.0, 4.0, 5.0, 6.0] for name in "abc"}  # warm-ups dropped, iteration i of each aligned

"""Percentiles, spread and the memory plateau verdict on known inputs."""
from __future__ import annotations

import random

import pytest

from r9k.bench.stats import MIB, memory_plateau, percentile, spread, summarize


def test_percentiles_match_linear_interpolation():
    xs = list(range(1, 101))
    random.Random(0).shuffle(xs)
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 100
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["p50"] == 2.5 and s["max"] == 4.0


def test_spread_reports_half_range_percent():
    s = spread([0.9, 1.0, 1.1])
    assert s["mean"] == pytest.approx(1.0)
    assert s["half_range_pct"] == pytest.approx(10.0)
    assert (s["min"], s["max"]) == (0.9, 1.1)


def _samples(f, n=120, dt=5.0):
    return [(i * dt, f(i)) for i in range(n)]


def test_flat_memory_with_noise_and_warmup_growth_is_flat():
    rng = random.Random(1)
    base = 2000 * MIB
    # fast growth during the first 20% (warm-up), then noise of +-8 MiB around a plateau
    samples = _samples(lambda i: base - (24 - i) * 20 * MIB * (i < 24) + rng.uniform(-8, 8) * MIB)
    v = memory_plateau(samples)
    assert v["verdict"] == "flat" and v["flat"] is True
    assert abs(v["peak_growth_bytes"]) <= v["tolerance_bytes"] == pytest.approx(0.02 * v["peak_first_third_bytes"])
    assert "25%" in v["criterion"]


def test_slow_leak_is_growing():
    # 1 MiB per sample over 120 samples: 90 MiB across the window > 2% of 1 GiB (20 MiB)
    v = memory_plateau(_samples(lambda i: 1024 * MIB + i * MIB))
    assert v["verdict"] == "growing" and v["flat"] is False
    assert v["trend_growth_bytes"] == pytest.approx(89 * MIB, rel=0.01)
    assert v["slope_bytes_per_s"] == pytest.approx(MIB / 5, rel=0.01)


def test_step_up_late_in_the_run_is_growing_but_within_tolerance_is_flat():
    late_jump = _samples(lambda i: 1024 * MIB + (100 * MIB if i > 100 else 0))
    assert memory_plateau(late_jump)["flat"] is False
    small = _samples(lambda i: 1024 * MIB + (10 * MIB if i > 100 else 0))
    assert memory_plateau(small)["flat"] is True  # 10 MiB < max(2% of 1 GiB, 32 MiB)


def test_too_few_samples_gives_no_verdict():
    assert memory_plateau([])["verdict"] == "not_sampled"
    v = memory_plateau(_samples(lambda i: 1.0, n=6))
    assert v["verdict"] == "too_few_samples" and v["flat"] is None

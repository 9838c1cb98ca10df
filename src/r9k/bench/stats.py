"""Statistics for the benchmark reports: percentiles, spread, and the memory plateau verdict."""
from __future__ import annotations

import math
from typing import Any, Sequence

MIB = 1 << 20


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p}: expected 0..100")
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(values), "mean": sum(values) / len(values),
                           "min": min(values), "max": max(values)}
    for p in ps:
        out[f"p{p:g}"] = percentile(values, p)
    return out


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, median, min, max and relative half-range of repeated measurements."""
    if not values:
        return {"n": 0}
    mean = sum(values) / len(values)
    return {"n": len(values), "mean": mean, "median": percentile(values, 50),
            "min": min(values), "max": max(values),
            "half_range_pct": 50 * (max(values) - min(values)) / mean if mean else None,
            "values": list(values)}


def ols_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    den = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / den if den else 0.0


def memory_plateau(samples: Sequence[tuple[float, float]], *, warmup_fraction: float = 0.25,
                   tolerance_fraction: float = 0.02, tolerance_min_bytes: float = 32 * MIB,
                   min_samples: int = 9) -> dict[str, Any]:
    """Did memory stop growing? samples: (seconds since start, bytes).

    Criterion (stated in every report): drop the first `warmup_fraction` of the run (allocator
    and cache warm-up); over the rest, (a) the peak of the last third exceeds the peak of the
    first third by at most the tolerance, and (b) the least-squares trend extrapolated across
    the window grows by at most the tolerance. Tolerance = max(tolerance_fraction x the
    window's first-third peak, tolerance_min_bytes).
    """
    criterion = (f"after dropping the first {warmup_fraction:.0%} of the run: peak(last third) - "
                 f"peak(first third) <= tol and least-squares trend x window <= tol, "
                 f"tol = max({tolerance_fraction:.0%} of peak(first third), "
                 f"{tolerance_min_bytes / MIB:.0f} MiB)")
    if len(samples) < 2:
        return {"verdict": "not_sampled" if not samples else "too_few_samples",
                "flat": None, "criterion": criterion, "samples": len(samples)}
    t_end = samples[-1][0]
    t_start = samples[0][0]
    cut = t_start + warmup_fraction * (t_end - t_start)
    window = [(t, y) for t, y in samples if t >= cut]
    if len(window) < min_samples:
        return {"verdict": "too_few_samples", "flat": None, "criterion": criterion,
                "samples": len(samples), "window_samples": len(window),
                "needed": min_samples}
    third = len(window) // 3
    first, last = window[:third], window[-third:]
    peak_first = max(y for _, y in first)
    peak_last = max(y for _, y in last)
    tol = max(tolerance_fraction * peak_first, tolerance_min_bytes)
    ts = [t for t, _ in window]
    ys = [y for _, y in window]
    slope = ols_slope(ts, ys)
    trend_growth = slope * (ts[-1] - ts[0])
    peak_growth = peak_last - peak_first
    flat = peak_growth <= tol and trend_growth <= tol
    return {"verdict": "flat" if flat else "growing", "flat": flat, "criterion": criterion,
            "samples": len(samples), "window_samples": len(window),
            "window_start_s": ts[0], "window_end_s": ts[-1],
            "peak_first_third_bytes": peak_first, "peak_last_third_bytes": peak_last,
            "peak_growth_bytes": peak_growth, "trend_growth_bytes": trend_growth,
            "slope_bytes_per_s": slope, "tolerance_bytes": tol,
            "min_bytes": min(ys), "max_bytes": max(ys)}

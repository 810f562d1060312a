"""Small statistics for benchmarks: medians, percentiles, ratios (no numpy needed)."""

from __future__ import annotations

import math
import statistics


def median(values: list[float]) -> float | None:
    """The median, or None for no values (a column with nothing measured)."""
    return statistics.median(values) if values else None


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0..100), linear interpolation between closest ranks (numpy's default);
    None for no values."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile p must be in [0, 100], got {p}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(num: float, den: float) -> float | None:
    """num / den, or None when den is 0 (nothing to compare against)."""
    return num / den if den else None

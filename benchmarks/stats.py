"""Small statistics shared by the benchmarks."""

from __future__ import annotations


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank `q`th percentile of already sorted values; NaN when there are none."""
    if not sorted_values:
        return float("nan")
    idx = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[idx]

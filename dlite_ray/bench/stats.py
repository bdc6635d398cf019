"""Order statistics the benchmarks report (load test, soak, `dlite-ray bench`)."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile by nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def quartiles(values: list[float]) -> list[float] | None:
    """[q1, q3] (inclusive method: defined from two values on)."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]

"""The statistics of a report: intervals on rates, passes to a threshold, a power law fitted to them.

Nothing here needs torch: the report is drawn from results.jsonl alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (sensible at 0/n and n/n, unlike the normal one)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def first_reaching(values: Sequence[float], threshold: float) -> int | None:
    """1-based index of the first value >= threshold (the number of passes it took), None if none does."""
    return next((i + 1 for i, v in enumerate(values) if v is not None and v >= threshold), None)


def loglog_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares of log10 y = slope * log10 x + intercept; None with fewer than two distinct points."""
    pts = [(math.log10(x), math.log10(y)) for x, y in zip(xs, ys) if x and y and x > 0 and y > 0]
    if len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return slope, my - slope * mx


def solve_loglog(fit: tuple[float, float], y: float) -> float | None:
    """The x at which the fitted line reaches y (None for a flat fit, or a near-flat one whose answer lies off
    every scale: 10 ** 1e9 would overflow)."""
    slope, intercept = fit
    if slope == 0:
        return None
    log_x = (math.log10(y) - intercept) / slope
    return 10 ** log_x if abs(log_x) <= 300 else None

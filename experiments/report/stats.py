"""The statistics of a report: intervals on rates (threshold crossings, power laws and bootstraps: crossing.py).

Nothing here needs torch: the report is drawn from results.jsonl alone.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n (sensible at 0/n and n/n, unlike the normal one)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At 0/n and n/n the bound equals p exactly; rounding would leave it a hair past p (an error bar of -3e-17).
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))

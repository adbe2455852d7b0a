"""What every benchmark shares: the machine it ran on, timing, paired ratios, rank correlation, tables, JSON.

A figure is only readable beside the CPU it was measured on (machines differ: with or without native bf16),
and on a shared machine only as medians and paired ratios (each step of one side next to the same step of
the other, so load drifting between steps hits both alike).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence


def machine() -> str:
    """The CPU model, its core count and whether it has native bf16 (lscpu's fields, from /proc/cpuinfo)."""
    model, flags = platform.processor() or "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    bf16 = "native bf16 (" + ", ".join(sorted(flags & {"avx512_bf16", "amx_bf16"})) + ")" \
        if flags & {"avx512_bf16", "amx_bf16"} else "no native bf16 (AVX2 only)" if "avx2" in flags else "?"
    return f"{model}, {os.cpu_count()} cores, {bf16}"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def median_time(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median wall seconds of `fn` over `reps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-step ratios a[i] / b[i] (steps measured back to back)."""
    return statistics.median(x / y for x, y in zip(a, b))


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation: the Pearson correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, floats as given."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def write_json(path: str | None, figures: dict) -> None:
    """Write the figures to `path` (nothing when None), with the machine they were measured on."""
    if path:
        with open(path, "w") as f:
            json.dump({"machine": machine(), **figures}, f, indent=1, default=str)

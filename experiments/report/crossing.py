"""Where a dose-response curve crosses a threshold, with intervals that include run-to-run variance.

A dose is what a canary was given: copies inside one pass, or passes. For each model size the memorized share
(exact match) is read at every dose, made monotone (isotonic regression weighted by the canaries at each dose:
more copies cannot make memorization less likely, so a dip is noise), and the dose at which it first reaches the
threshold is interpolated between the two doses around it (in log2 dose for copies, which double from level to
level). A curve that never reaches the threshold is right-censored: its crossing is only known to lie above the
largest dose (a lower bound). One already at the threshold at the smallest dose is left-censored (an upper bound).

Intervals come from a cluster bootstrap: resample the seeds (each a whole run: its canaries, rows and order), and
inside each drawn seed its canaries: stratified by dose when each canary has one dose (copies), or each canary
with its whole curve when it was scored at every dose (passes); a canary keeps its results at every size, so
sizes stay paired. A bound is never turned into a number: a percentile that falls on a censored replicate is reported as
unbounded on that side, and an extrapolation whose interval is unbounded prints no number. Across sizes, a power law
with censored sizes has no slope, but where they all pull it one way the fit with them at their bounds bounds it on
that side (bounded_slope), and the interval keeps that side's end.

Nothing here needs torch: the report is drawn from results.jsonl alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Unit = dict
"""One canary of one seed at one dose: {"seed", "id", "dose", and per size key the canary's 0/1 (or float)
outcome}; with a "canary" key (the canary's id) when the same canary has a unit at several doses."""


def monotone(doses: Sequence[float], rates: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Non-decreasing least-squares fit of rates over increasing doses (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted mean, weight, count]
    for r, w in zip(rates, weights):
        blocks.append([r, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (r1, w1, c1), (r2, w2, c2) = blocks.pop(-2), blocks.pop()
            w = w1 + w2
            blocks.append([(r1 * w1 + r2 * w2) / w if w else (r1 + r2) / 2, w, c1 + c2])
    return [b[0] for b in blocks for _ in range(b[2])]


@dataclass(frozen=True)
class Crossing:
    """The dose at which a curve reaches a threshold: `value`, or for a censored curve only a bound."""

    value: float | None
    above: float | None = None
    """Right-censored: the crossing lies above this dose (the largest measured)."""
    below: float | None = None
    """Left-censored: the crossing lies at or below this dose (the smallest measured)."""

    def as_number(self) -> float:
        """For percentiles: +inf above the measured range, -inf below it."""
        if self.value is not None:
            return self.value
        return math.inf if self.above is not None else -math.inf

    def label(self, fmt: str = "{:.3g}") -> str:
        if self.value is not None:
            return fmt.format(self.value)
        return f"> {fmt.format(self.above)}" if self.above is not None else f"<= {fmt.format(self.below)}"


def crossing(cells: Sequence[tuple[float, float, float]], threshold: float, log: bool = True) -> Crossing:
    """Crossing of `threshold` by the monotone fit of [(dose, k, n)] (doses > 0 when `log`)."""
    cells = sorted((d, k, n) for d, k, n in cells if n > 0)
    if not cells:
        raise ValueError("no dose has any canary")
    doses = [d for d, _, _ in cells]
    fit = monotone(doses, [k / n for _, k, n in cells], [n for _, _, n in cells])
    if fit[0] >= threshold:
        return Crossing(None, below=doses[0])
    for (d0, r0), (d1, r1) in zip(zip(doses, fit), zip(doses[1:], fit[1:])):
        if r1 >= threshold:
            x0, x1 = (math.log2(d0), math.log2(d1)) if log else (d0, d1)
            x = x0 + (threshold - r0) / (r1 - r0) * (x1 - x0)
            return Crossing(2 ** x if log else x)
    return Crossing(None, above=doses[-1])


def cells_of(units: Sequence[Unit], key: str) -> list[tuple[float, float, int]]:
    """[(dose, k, n)] of one size's outcomes over `units`."""
    by_dose: dict = defaultdict(lambda: [0.0, 0])
    for u in units:
        if u.get(key) is not None:
            by_dose[u["dose"]][0] += float(u[key])
            by_dose[u["dose"]][1] += 1
    return [(d, k, n) for d, (k, n) in sorted(by_dose.items())]


def _draws(units: Sequence[Unit], n_boot: int, seed: int):
    """The positions in `units` of each of `cluster_resamples`'s samples, in the same order."""
    by_seed: dict = defaultdict(lambda: (defaultdict(list), defaultdict(list)))
    for i, u in enumerate(units):
        by_dose, by_canary = by_seed[u["seed"]]
        (by_canary[u["canary"]] if "canary" in u else by_dose[u["dose"]]).append(i)
    seeds = sorted(by_seed)
    groups = [([np.asarray(g) for g in by_seed[s][0].values()], [np.asarray(c) for c in by_seed[s][1].values()])
              for s in seeds]
    rng = np.random.default_rng(seed)
    for _ in range(n_boot):
        parts = []
        for s in rng.choice(len(seeds), size=len(seeds)):
            by_dose, by_canary = groups[int(s)]
            for group in by_dose:
                parts.append(group[rng.integers(0, len(group), size=len(group))])
            if by_canary:
                parts.extend(by_canary[int(i)] for i in rng.integers(0, len(by_canary), size=len(by_canary)))
        yield np.concatenate(parts) if parts else np.zeros(0, dtype=int)


def cluster_resamples(units: Sequence[Unit], n_boot: int = 1000, seed: int = 0):
    """Yield `n_boot` bootstrap samples of `units`: seeds drawn with replacement, then within each drawn seed
    its canaries drawn with replacement.

    A unit without a "canary" key is one canary at one dose: they are drawn at each dose (stratified, so every
    dose keeps its count). Units sharing a "canary" key are one canary's whole curve (the passes study scores
    the same canary after every pass): the canary is drawn, and brings all its units, so the correlation
    along a curve stays in the interval. A drawn seed keeps its number of canaries either way."""
    for idx in _draws(units, n_boot, seed):
        yield [units[int(i)] for i in idx]


class _Cells:
    """`cells_of` for many samples of the same units, a sample given as positions in them: the outcomes are
    read into arrays once (a bootstrap asks for thousands of samples of thousands of units)."""

    def __init__(self, units: Sequence[Unit], keys: Sequence[str]):
        doses, self.code = np.unique(np.asarray([u["dose"] for u in units]), return_inverse=True)
        self.doses = doses.tolist()
        self.seen = {k: np.asarray([u.get(k) is not None for u in units], dtype=bool) for k in keys}
        self.y = {k: np.asarray([float(u[k]) if u.get(k) is not None else 0.0 for u in units]) for k in keys}

    def __call__(self, idx: np.ndarray, key: str) -> list[tuple[float, float, int]]:
        idx = idx[self.seen[key][idx]]
        k = np.bincount(self.code[idx], weights=self.y[key][idx], minlength=len(self.doses))
        n = np.bincount(self.code[idx], minlength=len(self.doses))
        return [(d, kd, nd) for d, kd, nd in zip(self.doses, k.tolist(), n.tolist()) if nd]


def percentile_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Equal-tailed percentile interval; a tail that lands on +-inf stays infinite (unbounded)."""
    v = np.sort(np.asarray(values, dtype=float))
    lo_i = int(math.floor((1 - level) / 2 * (len(v) - 1)))
    hi_i = int(math.ceil((1 + level) / 2 * (len(v) - 1)))
    return float(v[lo_i]), float(v[hi_i])


def unknown_interval(values: Sequence[float], known: Sequence[bool], level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of replicates of which some are unknown (a censored size leaves their value
    anywhere): each end counts the unknown ones as lying beyond it, so it stays finite only while they fit in its
    tail, and dropping them never narrows it."""
    lo = percentile_interval([v if k else -math.inf for v, k in zip(values, known)], level)[0]
    hi = percentile_interval([v if k else math.inf for v, k in zip(values, known)], level)[1]
    return lo, hi


def bootstrap(units: Sequence[Unit], stat: Callable[[Sequence[Unit]], float], n_boot: int = 1000,
              seed: int = 0) -> tuple[float, float]:
    """95% cluster-bootstrap interval of `stat` (a statistic of a sample of units; +-inf for a bound)."""
    return percentile_interval([stat(s) for s in cluster_resamples(units, n_boot, seed)])


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float] | None:
    """Least squares of log10 y on log10 x: (slope, intercept); None unless every point is finite and > 0 and
    there are two distinct x."""
    if any(not (math.isfinite(v) and v > 0) for v in (*xs, *ys)) or len(set(xs)) < 2:
        return None
    lx, ly = np.log10(xs), np.log10(ys)
    slope, intercept = np.polyfit(lx, ly, 1)
    return float(slope), float(intercept)


def bounded_slope(xs: Sequence[float], crossings: Sequence[Crossing]) -> tuple[str, float] | None:
    """What a power law's slope still says when some sizes are censored: the least-squares slope with each censored
    crossing set at its bound, and whether that is an "upper" or a "lower" bound on the slope. A crossing raised at a
    size left of the mean of log x lowers the slope, one at a size right of it raises it (the slope's weight on a
    point is its log x minus the mean): a right-censored size (true crossing above its bound) left of the mean, or a
    left-censored one right of it, makes the substituted slope an upper bound, and the mirror cases a lower one.
    None when the censored sizes pull both ways (or sit at the mean), or nothing is censored."""
    if all(c.value is not None for c in crossings) or len(set(xs)) < 2:
        return None
    ys = [c.value if c.value is not None else (c.above if c.above is not None else c.below) for c in crossings]
    fit = loglog_slope(xs, ys)
    if fit is None:
        return None
    mean = float(np.mean(np.log10(xs)))
    sides = set()
    for x, c in zip(xs, crossings):
        if c.value is None:
            if math.log10(x) == mean:
                return None
            sides.add("upper" if (math.log10(x) < mean) == (c.above is not None) else "lower")
    return (sides.pop(), fit[0]) if len(sides) == 1 else None


def solve_for_x(fit: tuple[float, float] | None, y: float, max_log10: float = 300.0) -> float:
    """The x at which log10 y = slope log10 x + intercept reaches `y`: +inf when it never does within
    10^max_log10 (a flat or rising fit, or one so shallow that the answer is off any scale) or for no fit."""
    if fit is None:
        return math.inf
    slope, intercept = fit
    if slope >= 0:
        return math.inf
    log_x = (math.log10(y) - intercept) / slope
    return 10 ** log_x if abs(log_x) <= max_log10 else math.inf


def size_trend(units: Sequence[Unit], sizes: dict[str, float], threshold: float, log: bool = True,
               n_boot: int = 1000, seed: int = 0) -> dict:
    """Per size its crossing (point estimate and cluster-bootstrap interval); across sizes the power law of
    crossing vs parameters and the size at which it reaches a dose of 1 (one copy, or one pass), each with its
    interval. `sizes`: outcome key -> parameters."""
    cells = _Cells(units, list(sizes))

    def crossings(idx):
        return {key: crossing(cells(idx, key), threshold, log) for key in sizes}

    def fit_of(cr):
        keys = list(sizes)
        return loglog_slope([sizes[k] for k in keys], [cr[k].as_number() for k in keys])

    def bound_of(cr):
        keys = list(sizes)
        return bounded_slope([sizes[k] for k in keys], [cr[k] for k in keys])

    point = crossings(np.arange(len(units)))
    reps = [crossings(idx) for idx in _draws(units, n_boot, seed)]
    fits = [fit_of(cr) for cr in reps]  # None: a size censored in that replicate
    slopes = [f[0] if f else math.nan for f in fits]
    known = [f is not None for f in fits]
    # a replicate with a censored size bounds the slope without giving it: each end stays finite only while such
    # replicates fit in its 2.5% tail, or, where all of them bound the slope the same way, on that way's side
    slope_ci = unknown_interval(slopes, known)
    if slope_ci == (-math.inf, math.inf) and not all(known):
        slope_ci = _one_sided(slopes, [bound_of(cr) if f is None else None for f, cr in zip(fits, reps)])
    one = [solve_for_x(f, 1.0) for f in fits]
    fit = fit_of(point)
    return {
        "threshold": threshold,
        "sizes": {k: {"params": sizes[k], "crossing": point[k],
                      "interval": percentile_interval([cr[k].as_number() for cr in reps])} for k in sizes},
        "slope": fit[0] if fit else None, "slope_interval": slope_ci, "replicates_censored": known.count(False),
        "slope_bound": None if fit else bound_of(point),
        "dose_one_params": solve_for_x(fit, 1.0) if fit else math.inf,
        "dose_one_interval": unknown_interval(one, known),
    }


def _one_sided(slopes: list[float], bounds: list[tuple[str, float] | None]) -> tuple[float, float]:
    """The slope's interval when censored replicates all bound it on one side: each such replicate's slope lies
    beyond its substituted one (bounded_slope) on that side only, so the percentile of the substituted values is a
    conservative end on the bounded side; the other side stays unbounded. Either side where they disagree."""
    sides = {b[0] if b else None for s, b in zip(slopes, bounds) if not math.isfinite(s)}
    if len(sides) != 1 or None in sides:
        return -math.inf, math.inf
    values = [s if math.isfinite(s) else b[1] for s, b in zip(slopes, bounds)]
    lo, hi = percentile_interval(values)
    return (-math.inf, hi) if sides == {"upper"} else (lo, math.inf)


def slope_label(trend: dict) -> str:
    """A size_trend's slope as the report prints it: the fit, or the bound its censored sizes leave, or none."""
    if trend["slope"] is not None:
        return f"{trend['slope']:.2f}"
    if trend["slope_bound"] is None:
        return "none (a size is censored)"
    side, value = trend["slope_bound"]
    return f"{'at most' if side == 'upper' else 'at least'} {value:.2f} (censored sizes set at their bounds)"


def extrapolation_band(units: Sequence[Unit], sizes: dict[str, float], thresholds: Sequence[float] = (0.2, 0.5, 0.7),
                       log: bool = True, n_boot: int = 1000, seed: int = 0) -> dict:
    """The size that would reach each threshold at a dose of 1, over thresholds: the band from the lowest lower
    bound to the highest upper bound of their intervals. Unbounded (None) when any is."""
    per = {t: size_trend(units, sizes, t, log, n_boot, seed) for t in thresholds}
    lows = [p["dose_one_interval"][0] for p in per.values()]
    highs = [p["dose_one_interval"][1] for p in per.values()]
    bounded = all(math.isfinite(v) and v > 0 for v in (*lows, *highs))
    return {"per_threshold": per, "band": (min(lows), max(highs)) if bounded else None}

"""Threshold crossings with censoring and cluster-bootstrap intervals, against answers worked out by hand."""

import math

import numpy as np
import pytest

from experiments.report.crossing import (
    Crossing,
    bootstrap,
    bounded_slope,
    cells_of,
    cluster_resamples,
    crossing,
    extrapolation_band,
    loglog_slope,
    monotone,
    percentile_interval,
    size_trend,
    slope_label,
    solve_for_x,
    unknown_interval,
)


def test_monotone_pools_a_dip_with_its_neighbour_by_weight():
    assert monotone([1, 2, 4], [0.2, 0.6, 0.4], [10, 10, 10]) == pytest.approx([0.2, 0.5, 0.5])
    assert monotone([1, 2, 4], [0.2, 0.6, 0.3], [10, 10, 30]) == pytest.approx([0.2, 0.375, 0.375])
    assert monotone([1, 2], [0.1, 0.9], [1, 1]) == [0.1, 0.9]  # already monotone: unchanged


def test_crossing_interpolates_in_log_dose_and_censors_at_both_ends():
    # 0.25 at 4 copies, 0.75 at 16: halfway in log2 between them is 8 copies
    assert crossing([(4, 1, 4), (16, 3, 4)], 0.5).value == pytest.approx(8.0)
    assert crossing([(4, 1, 4), (16, 3, 4)], 0.5, log=False).value == pytest.approx(10.0)
    right = crossing([(1, 0, 8), (32, 3, 8)], 0.5)
    assert right.value is None and right.above == 32 and right.as_number() == math.inf and right.label() == "> 32"
    left = crossing([(1, 5, 8), (2, 8, 8)], 0.5)
    assert left.value is None and left.below == 1 and left.as_number() == -math.inf and left.label() == "<= 1"
    # a dip (0.6 then 0.4) is noise: pooled to 0.5 at doses 2 and 4, the fit reaches 0.5 at dose 2 (raw rates
    # would cross between 1 and 2); with 0.55 asked, the pooled 0.5 is passed over and 4 -> 8 is interpolated
    assert crossing([(1, 2, 10), (2, 6, 10), (4, 4, 10), (8, 9, 10)], 0.5).value == pytest.approx(2.0)
    assert crossing([(1, 2, 10), (2, 6, 10), (4, 4, 10), (8, 9, 10)], 0.55).value == pytest.approx(2 ** 2.125)
    with pytest.raises(ValueError):
        crossing([(1, 0, 0)], 0.5)


def _units(rates: dict[str, dict[int, float]], seeds=(1, 2, 3), per_dose=10, seed=0):
    """Canaries whose outcome at each size is drawn with the given rate per dose."""
    rng = np.random.default_rng(seed)
    units = []
    for s in seeds:
        for dose in next(iter(rates.values())):
            for i in range(per_dose):
                u = {"seed": s, "id": f"{dose}-{i}", "dose": dose}
                for key, by_dose in rates.items():
                    u[key] = float(rng.random() < by_dose[dose])
                units.append(u)
    return units


def test_cluster_resamples_draw_whole_seeds_and_keep_every_dose_count():
    units = _units({"a": {1: 0.5, 4: 0.5}}, seeds=(1, 2), per_dose=3)
    for sample in cluster_resamples(units, n_boot=20, seed=1):
        assert len(sample) == len(units)
        for s in {u["seed"] for u in sample}:
            doses = [u["dose"] for u in sample if u["seed"] == s]
            assert doses.count(1) % 3 == 0 and doses.count(4) % 3 == 0  # a drawn seed brings 3 per dose
    assert cells_of(units, "a")[0][0] == 1 and cells_of(units, "a")[0][2] == 6


def test_bootstrap_interval_covers_the_rate_and_widens_with_seed_variance():
    same = [{"seed": s, "dose": 1, "id": i, "y": float(i < 5)} for s in range(4) for i in range(10)]
    varied = [{"seed": s, "dose": 1, "id": i, "y": float(i < 2 + 2 * s)} for s in range(4) for i in range(10)]
    rate = lambda sample: float(np.mean([u["y"] for u in sample]))  # noqa: E731
    lo, hi = bootstrap(same, rate, n_boot=400)
    lo2, hi2 = bootstrap(varied, rate, n_boot=400)
    assert lo < 0.5 < hi and lo2 < 0.5 < hi2
    assert hi2 - lo2 > hi - lo  # run-to-run variance enters the interval


def test_percentile_interval_keeps_an_infinite_tail_unbounded():
    assert percentile_interval([1.0] * 90 + [math.inf] * 10) == (1.0, math.inf)
    assert percentile_interval(list(range(101))) == (2.0, 98.0)


def test_power_law_solve_is_robust_to_flat_and_rising_fits():
    fit = loglog_slope([1e5, 1e6, 1e7], [16, 4, 1])  # copies to threshold fall 4x per decade
    assert fit[0] == pytest.approx(-math.log10(4))
    assert solve_for_x(fit, 1.0) == pytest.approx(1e7)
    assert solve_for_x((-1e-9, 5.0), 1.0) == math.inf  # near-flat: 10^(5e9), off every scale, no overflow
    assert solve_for_x((0.3, 1.0), 1.0) == math.inf and solve_for_x(None, 1.0) == math.inf
    assert loglog_slope([1e5, 1e6], [math.inf, 2]) is None and loglog_slope([1e5, 1e5], [2, 3]) is None


def test_censored_sizes_bound_the_slope_on_one_side_only():
    """Copies to 50% falling 4x per decade, with the smallest size censored (> 64, true 256): the slope with 64
    put in is an upper bound, and the true one lies below it. Censored at both ends, the bounds pull both ways."""
    xs = [1e5, 1e6, 1e7, 1e8]
    exact = [Crossing(256.0), Crossing(64.0), Crossing(16.0), Crossing(4.0)]
    true_slope = loglog_slope(xs, [c.value for c in exact])[0]
    assert bounded_slope(xs, exact) is None  # nothing censored: the fit itself
    side, at_most = bounded_slope(xs, [Crossing(None, above=64.0), *exact[1:]])
    assert side == "upper" and true_slope < at_most < 0
    assert at_most == pytest.approx(loglog_slope(xs, [64, 64, 16, 4])[0])
    # left-censored at the largest size (true 4, at or below 8): an upper bound again
    assert bounded_slope(xs, [*exact[:3], Crossing(None, below=8.0)])[0] == "upper"
    # right-censored at the largest: the slope can only be higher
    assert bounded_slope(xs, [*exact[:3], Crossing(None, above=2.0)])[0] == "lower"
    assert bounded_slope(xs, [Crossing(None, above=64.0), *exact[1:3], Crossing(None, above=2.0)]) is None
    middle = [Crossing(8.0), Crossing(None, above=8.0), Crossing(2.0)]
    assert bounded_slope([1e5, 1e6, 1e7], middle) is None  # at the mean of log x: no side


def test_censored_replicates_widen_an_interval_and_never_narrow_it():
    """A replicate with a censored size has no value, and may lie anywhere: each end counts such replicates beyond
    it. Up to 24 of 1000 fit in a 2.5% tail (the ends stay finite, but move out); 25 reach each end."""
    values = [float(v) for v in range(1000)]
    assert unknown_interval(values, [True] * 1000) == percentile_interval(values) == (24.0, 975.0)
    known = [True] * 976 + [False] * 24  # the replicates 976..999 were censored
    lo, hi = unknown_interval(values, known)
    dropped = percentile_interval(values[:976])
    assert lo == 0.0 < dropped[0] and hi == 975.0 > dropped[1]  # dropping them would narrow both ends
    assert unknown_interval(values, [True] * 975 + [False] * 25) == (-math.inf, math.inf)


def test_size_trend_known_answer_and_censored_sizes():
    doses = (1, 2, 4, 8, 16, 32)
    # small needs ~16 copies for 50%, large ~2; "flat" never reaches 50% (right-censored)
    small = {d: min(1.0, 0.5 * d / 16) for d in doses}
    large = {d: min(1.0, 0.5 * d / 2) for d in doses}
    flat = {d: 0.05 for d in doses}
    units = _units({"small": small, "large": large, "flat": flat}, per_dose=40)
    trend = size_trend(units, {"small": 1e5, "large": 1e6}, 0.5, n_boot=200)
    assert 8 < trend["sizes"]["small"]["crossing"].value < 32 and 1 < trend["sizes"]["large"]["crossing"].value < 4
    lo, hi = trend["sizes"]["small"]["interval"]
    assert lo < trend["sizes"]["small"]["crossing"].value < hi
    assert trend["slope_interval"][1] < 0  # copies to 50% fall with size, interval excludes 0
    assert 1e6 < trend["dose_one_params"] < 1e8
    censored = size_trend(units, {"small": 1e5, "flat": 1e6}, 0.5, n_boot=200)
    assert censored["sizes"]["flat"]["crossing"] == Crossing(None, above=32)
    assert censored["sizes"]["flat"]["interval"][1] == math.inf
    assert censored["slope"] is None and censored["dose_one_params"] == math.inf
    # the large size's crossing lies above 32: the slope at least that of (small, 32), whatever it is
    side, at_least = censored["slope_bound"]
    small_x = censored["sizes"]["small"]["crossing"].value
    assert side == "lower" and at_least == pytest.approx(math.log10(32 / small_x))
    lo, hi = censored["slope_interval"]
    assert hi == math.inf and lo < at_least and slope_label(censored) == f"at least {at_least:.2f} (censored sizes " \
        "set at their bounds)"
    band = extrapolation_band(units, {"small": 1e5, "flat": 1e6}, n_boot=50)
    assert band["band"] is None  # unbounded: no number to print


def _curves(by_seed: dict[int, dict[str, list[int]]], cluster: bool = True) -> list[dict]:
    """One unit per (seed, canary, dose 1, 2, ...) from each canary's 0/1 curve; with the "canary" key or not."""
    return [{"seed": s, "id": cid, "dose": dose, "y": float(y), **({"canary": cid} if cluster else {})}
            for s, curves in by_seed.items() for cid, ys in curves.items() for dose, y in enumerate(ys, 1)]


def test_canary_clusters_are_drawn_with_their_whole_curve():
    units = _curves({1: {"a": [0, 1, 1], "b": [0, 0, 0]}, 2: {"c": [0, 1, 1], "d": [1, 1, 1]}})
    for sample in cluster_resamples(units, n_boot=50, seed=3):
        assert len(sample) == len(units)
        for s in {u["seed"] for u in sample}:
            mine = [u for u in sample if u["seed"] == s]
            assert len(mine) % 6 == 0  # a drawn seed brings 2 canaries, each with its 3 doses
            for cid in {u["canary"] for u in mine}:
                doses = sorted(u["dose"] for u in mine if u["canary"] == cid)
                assert doses == sorted([1, 2, 3] * (len(doses) // 3))


def test_canary_clusters_known_answers():
    def rate(dose):
        return lambda sample: float(np.mean([u["y"] for u in sample if u["dose"] == dose]))

    # every canary of every seed has the same curve: nothing to resample, a zero-width interval
    same = _curves({s: {f"c{i}": [0, 1, 1] for i in range(4)} for s in (1, 2, 3)})
    assert bootstrap(same, rate(2), n_boot=200) == (1.0, 1.0)
    trend = size_trend([dict(u, big=u["y"]) for u in same], {"big": 1e6}, 0.5, log=False, n_boot=100)
    assert trend["sizes"]["big"]["crossing"].value == pytest.approx(1.5)
    assert trend["sizes"]["big"]["interval"] == pytest.approx((1.5, 1.5))
    # one seed whose two canaries differ (always vs never exact): a replicate draws aa, ab or bb, so the rate's
    # interval spans both curves
    apart = _curves({1: {"a": [1, 1], "b": [0, 0]}})
    assert bootstrap(apart, rate(1), n_boot=400) == (0.0, 1.0)
    # a canary's doses move together: the rate at dose 1 minus at dose 2 is 0 in every replicate; drawn per
    # dose instead (no "canary" key: the single-pass way), the two doses vary apart
    diff = lambda sample: rate(1)(sample) - rate(2)(sample)  # noqa: E731
    assert bootstrap(apart, diff, n_boot=400) == (0.0, 0.0)
    lo, hi = bootstrap(_curves({1: {"a": [1, 1], "b": [0, 0]}}, cluster=False), diff, n_boot=400)
    assert lo < 0 < hi

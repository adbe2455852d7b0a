"""The report's statistics against values computed by hand."""

import math

import pytest

from experiments.report.stats import first_reaching, loglog_fit, solve_loglog, wilson


def test_wilson_interval_known_values():
    lo, hi = wilson(0, 32)
    assert lo == 0 and hi == pytest.approx(1.959964**2 / (32 + 1.959964**2))  # z^2 / (n + z^2) at k = 0
    lo, hi = wilson(16, 32)
    assert lo == pytest.approx(1 - hi) and 0.33 < lo < 0.34  # symmetric at one half
    lo, hi = wilson(32, 32)
    assert hi == 1 and lo == pytest.approx(32 / (32 + 1.959964**2))
    assert wilson(3, 10)[0] < 0.3 < wilson(3, 10)[1]
    assert wilson(0, 0) == (0.0, 1.0)


def test_power_law_fit_and_its_extrapolation():
    xs = [1e5, 4e5, 1.6e6, 6.4e6]
    ys = [40 * (x / 1e5) ** -0.5 for x in xs]
    slope, intercept = loglog_fit(xs, ys)
    assert slope == pytest.approx(-0.5) and 10 ** intercept == pytest.approx(40 * 1e5 ** 0.5)
    assert solve_loglog((slope, intercept), 1.0) == pytest.approx(1e5 * 40 ** 2)
    assert loglog_fit([1e5], [3]) is None and loglog_fit([1e5, 1e5], [3, 4]) is None
    assert math.isclose(solve_loglog((0.0, 1.0), 1.0) or 0, 0)  # a flat fit never reaches one pass
    assert solve_loglog((-1e-9, 1.0), 1.0) is None  # near-flat: 10 ** 1e9, no OverflowError


def test_first_pass_reaching_a_threshold():
    assert first_reaching([0.0, 0.2, 0.5, 0.4, 0.9], 0.5) == 3
    assert first_reaching([0.1, None, 0.2], 0.5) is None

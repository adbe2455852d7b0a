"""The report's statistics against values computed by hand."""

import pytest

from experiments.report.aggregate import agg
from experiments.report.stats import wilson


def test_wilson_interval_known_values():
    lo, hi = wilson(0, 32)
    assert lo == 0 and hi == pytest.approx(1.959964**2 / (32 + 1.959964**2))  # z^2 / (n + z^2) at k = 0
    lo, hi = wilson(16, 32)
    assert lo == pytest.approx(1 - hi) and 0.33 < lo < 0.34  # symmetric at one half
    lo, hi = wilson(32, 32)
    assert hi == 1 and lo == pytest.approx(32 / (32 + 1.959964**2))
    assert wilson(3, 10)[0] < 0.3 < wilson(3, 10)[1]
    assert wilson(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize("n", range(1, 200))
def test_wilson_bounds_hold_the_rate_exactly(n):
    # at k = 0 and k = n the bound is the rate itself; rounding once left it 3e-17 past (n = 12), and a
    # figure's error bar of -3e-17 made matplotlib refuse to draw
    for k in (0, n // 2, n):
        lo, hi = wilson(k, n)
        assert 0 <= lo <= k / n <= hi <= 1
    assert wilson(0, n)[0] == 0 and wilson(n, n)[1] == 1


@pytest.mark.parametrize("n", range(1, 40))
def test_a_mean_over_seeds_stays_within_their_range(n):
    # three seeds of 0.1 summed to 0.30000000000000004, and their mean's bar of -1e-17 made matplotlib refuse to draw
    for v in (0.1, 0.7, 1 / 3, 2.675):
        mean, lo, hi, count = agg([v] * n + [None])
        assert lo <= mean <= hi and lo == hi == v and count == n
    assert agg([1.0, 2.0, 6.0]) == (3.0, 1.0, 6.0, 3) and agg([None]) is None

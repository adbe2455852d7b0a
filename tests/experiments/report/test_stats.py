"""The report's statistics against values computed by hand."""

import pytest

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
